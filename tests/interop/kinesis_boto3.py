#!/usr/bin/env python3
"""boto3 on the test Kinesis server, for tests/tests/interop_kinesis.rs.

  kinesis_boto3.py put ENDPOINT REGION STREAM N   put N plain JSON records (PartitionKey
                                                  "user-<i % 3>"), print one sequence number
                                                  per line
  kinesis_boto3.py read ENDPOINT REGION STREAM N  read N records from every shard's trim
                                                  horizon and decode onceflow's envelope with
                                                  kinesis_envelope.py; print one JSON line each
"""
import json
import os
import sys
import time

import boto3

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kinesis_envelope  # noqa: E402


def client(endpoint, region):
    # Dummy credentials: the local server checks that requests are signed, not by whom.
    return boto3.client("kinesis", endpoint_url=endpoint, region_name=region,
                        aws_access_key_id="onceflow-interop",
                        aws_secret_access_key="onceflow-interop")


def put(kc, stream, n):
    for i in range(n):
        body = json.dumps({"order": i, "source": "boto3"}).encode()
        r = kc.put_record(StreamName=stream, Data=body, PartitionKey="user-%d" % (i % 3))
        print(r["SequenceNumber"])


def read(kc, stream, n):
    got = []
    deadline = time.time() + 30
    while len(got) < n and time.time() < deadline:
        got = []
        for shard in kc.list_shards(StreamName=stream)["Shards"]:
            it = kc.get_shard_iterator(StreamName=stream, ShardId=shard["ShardId"],
                                       ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
            while it:
                r = kc.get_records(ShardIterator=it, Limit=1000)
                got.extend(r["Records"])
                if not r["Records"]:
                    break
                it = r.get("NextShardIterator")
        time.sleep(0.2)
    for rec in got:
        d = kinesis_envelope.decode(rec["Data"])
        print(json.dumps({
            "partition_key": rec["PartitionKey"],
            "enveloped": d["enveloped"],
            "headers": {name: (None if v is None else v.decode("utf-8", "replace"))
                        for name, v in d["headers"]},
            "timestamp": d["timestamp"],
            "payload": d["payload"].decode("utf-8", "replace"),
        }))


if __name__ == "__main__":
    cmd, endpoint, region, stream, n = sys.argv[1:6]
    kc = client(endpoint, region)
    {"put": put, "read": read}[cmd](kc, stream, int(n))
