"""What the tests share, one concept per module; no test module imports another.

- `data`: deterministic bytes of test files (`blob`, `content`) and trees of them (`make_files`).
- `cli`: the `tierstore` command line run as a user runs it (`cli`, `agent_cli`, `stream_cli`,
  `tierstore_run`).
- `wait`: polling until something holds (`wait_for`, `until`).
- `stores`: the stand-in shared store (FUSE) and its counters (`mounted_store`, `store_stats`).
- `agents`: node agents and the client processes that talk to them (`start_agent`, `child`).
- `cluster`: nodes of one job on this machine's loopback, and the dataset they read.
- `stream`: what the process-group streaming tests share (the ranks' model, their output).
- `soak`: soak sizes and kill counts, from `TIERSTORE_TEST_*` variables with CI's values as defaults.
- `marks`: the markers a fixture gives the tests that use it.
"""
