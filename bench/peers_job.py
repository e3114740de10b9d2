"""The warm-up floor of bench/bench_peers.py: boto3 downloading every object under an S3 prefix, 32 at a
time, into a directory, as a user's own script would fill a cache.

It lists the prefix, then fetches every object from 32 threads and prints a JSON line: seconds (listing
included), objects and bytes. An object up to boto3's multipart threshold (8 MiB) is one `get_object`
streamed to its file; a larger one goes through `download_file`, boto3's managed transfer (a HEAD, then
parallel ranges), so that the floor is as quick as boto3 gets without tuning. The endpoint and credentials come from the standard AWS variables. A program of its
own, so that its threads do not share an interpreter with the benchmark's latency proxy.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bucket", required=True)
    p.add_argument("--prefix", required=True, help="the keys' prefix, with its trailing /")
    p.add_argument("--dest", required=True, help="the directory the objects are written to")
    p.add_argument("--threads", type=int, default=32)
    args = p.parse_args()
    # One connection per thread at least; botocore's default pool (10) would queue the threads.
    config = Config(max_pool_connections=2 * args.threads, retries={"max_attempts": 2})
    client = boto3.client("s3", config=config)
    t0 = time.perf_counter()
    keys: list[tuple[str, int]] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=args.bucket, Prefix=args.prefix):
        keys += [(o["Key"], o["Size"]) for o in page.get("Contents", [])]

    threshold = TransferConfig().multipart_threshold

    def download(item: tuple[str, int]) -> None:
        key, size = item
        path = os.path.join(args.dest, key[len(args.prefix) :])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if size > threshold:
            client.download_file(args.bucket, key, path)
            return
        body = client.get_object(Bucket=args.bucket, Key=key)["Body"]
        with open(path, "wb") as f:
            while chunk := body.read(1 << 20):
                f.write(chunk)

    with ThreadPoolExecutor(args.threads) as pool:
        list(pool.map(download, keys))
    seconds = time.perf_counter() - t0
    print(
        json.dumps({"seconds": seconds, "objects": len(keys), "bytes": sum(n for _, n in keys)}), flush=True
    )


if __name__ == "__main__":
    main()
