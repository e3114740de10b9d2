"""What tierstore's tests and benchmarks stand on, shipped so that users can reproduce them: the stand-in
shared store (`slowfs`, a counting, latency-adding FUSE mount), a real S3 server on loopback (`s3server`,
SeaweedFS, with a latency-adding, request-counting proxy) and nodes made of network namespaces (`netns`).
None of it is part of the cache; nothing in `tierstore` imports it."""
