"""The command-line tools around the library: `optimisers demo`, `optimisers bench`.

They use the library only through its public API (`import optimisers as opt`, `optimisers.torch`,
`optimisers.optax`, `optimisers.schedules`, `optimisers.ops`), as any user's program would; nothing
in the library imports them.
"""
