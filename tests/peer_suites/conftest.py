"""The pinned upstream files are run by the harnesses beside this file, never collected as
they are (their tests would run torch's own classes, and need stand-ins to import)."""

collect_ignore_glob = ["upstream/*"]
