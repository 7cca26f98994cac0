#!/usr/bin/env python3
"""Writes the seeds of the coordinator and state_log fuzz targets (tests/fuzz/corpus/) from
requests in protobuf text format, encoded with protoc, so that they can be read and changed here.

  tests/fuzz/seeds.py       (from anywhere; needs protoc)
"""
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROTO_DIR = os.path.join(ROOT, "proto")
PROTO = "trn/coordinator/v1/coordinator.proto"
SEP = b"\n--trn-fuzz-part--\n"  # tests/fuzz/fuzz.h kSeparator
METHODS = ["JoinRequest", "SetRequest", "GetRequest", "AddRequest", "DeleteRequest", "BarrierRequest",
           "HeartbeatRequest", "ReportFailureRequest", "FinishRequest", "ReportShardRequest",
           "GetStatusRequest"]
TICK = 11


def encode(message, text):
    return subprocess.run(["protoc", "-I", PROTO_DIR, f"--encode=trn.coordinator.v1.{message}", PROTO],
                          input=text.encode(), capture_output=True, check=True).stdout


def call(message, text):
    return bytes([METHODS.index(message)]) + encode(message, text)


def tick(steps):
    return bytes([TICK, steps])


def write(target, name, parts):
    d = os.path.join(ROOT, "tests", "fuzz", "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(SEP.join(parts))


def job_session(job="j"):
    """Two nodes of two ranks: rendezvous, the store, a barrier, heartbeats, a checkpoint, the end."""
    join = 'job_id: "{j}" node_id: "{n}" host: "h{n}" nproc_per_node: 2 min_nodes: 2 max_nodes: 2 timeout_ms: 5000'
    parts = [call("JoinRequest", join.format(j=job, n="a")), call("JoinRequest", join.format(j=job, n="b")), tick(1)]
    parts += [
        call("SetRequest", f'job_id: "{job}" generation: 0 key: "rank0/addr" value: "10.0.0.1:1234"'),
        call("GetRequest", f'job_id: "{job}" generation: 0 key: "rank0/addr" timeout_ms: 100'),
        call("GetRequest", f'job_id: "{job}" generation: 0 key: "missing" timeout_ms: 300'),
        call("AddRequest", f'job_id: "{job}" generation: 0 key: "count" delta: 3 request_id: "r1"'),
        call("AddRequest", f'job_id: "{job}" generation: 0 key: "count" delta: 3 request_id: "r1"'),
        call("DeleteRequest", f'job_id: "{job}" generation: 0 key: "count"'),
    ]
    for r in range(4):
        parts.append(call("BarrierRequest", f'job_id: "{job}" generation: 0 name: "init" rank: {r} world_size: 4 timeout_ms: 1000'))
    parts.append(call("HeartbeatRequest", f'job_id: "{job}" generation: 0 kind: NODE rank: 0 host: "ha" pid: 10 '
                      'ranks { rank: 0 pid: 11 step: 3 loss: 2.5 tokens_per_s: 1000 coordinates { dp_rank: 0 } age_ms: 5 beats: 2 } '
                      'ranks { rank: 1 pid: 12 step: 3 loss: 2.5 val_loss: 2.4 recovery { recoveries: 1 goodput: 0.9 } }'))
    parts.append(call("HeartbeatRequest", f'job_id: "{job}" generation: 0 kind: WORKER rank: 2 host: "hb" pid: 13 step: 3 loss: 2.5'))
    for r in range(4):
        parts.append(call("ReportShardRequest", f'job_id: "{job}" generation: 0 step: 5 '
                          f'shard {{ rank: {r} path: "/ck/step-00000005/rank-0000{r}.shard" bytes: 4096 }}'))
    parts.append(call("GetStatusRequest", f'job_id: "{job}" max_ranks: 2 rank_start: 1 checkpoint_shards: true'))
    parts.append(tick(30))  # node b goes silent past the heartbeat timeout
    parts.append(call("GetStatusRequest", 'late_ms: 100 stuck_ms: 1000 dead_ms: 2000 max_attention: 3'))
    parts.append(call("FinishRequest", f'job_id: "{job}" generation: 0 node_rank: 0'))
    return parts


def main():
    write("coordinator", "two-nodes", job_session())
    failure = job_session("k")[:3] + [
        call("ReportFailureRequest", 'job_id: "k" generation: 0 rank: 3 reason: "rank 3 exited with 1"'),
        call("JoinRequest", 'job_id: "k" node_id: "a" host: "ha" nproc_per_node: 2 min_nodes: 1 max_nodes: 2 timeout_ms: 5000'),
        tick(5),
        call("ReportFailureRequest", 'job_id: "k" generation: 1 rank: 0 reason: "stopped" user_stop: true'),
        call("GetStatusRequest", 'job_id: "k"'),
    ]
    write("coordinator", "failure-and-rejoin", failure)

    # state_log: byte 1 (odd) and LogRecord payloads, framed by the target.
    job = ('job { job_id: "j" generation: 2 state: "running" '
           'members { node_rank: 0 node_id: "a" host: "ha" nproc: 2 rank_offset: 0 } '
           'members { node_rank: 1 node_id: "b" host: "hb" nproc: 2 rank_offset: 2 } '
           'restart_history { } restarts: 1 min_nodes: 2 max_nodes: 2 run_id: "r1" last_member_ids: "a" '
           'checkpoints { step: 5 } kv { generation: 2 key: "k" value: "v" } '
           'recovery { recoveries: 1 } } next_event_seq: 7')
    write("state_log", "two-records", [b"\x01" + encode("LogRecord", job),
                                        encode("LogRecord", 'removed_job: "old" next_event_seq: 8')])
    # byte 2: an older trn's state.pb, one Snapshot.
    snapshot = job.replace("job {", "jobs {", 1).replace(" next_event_seq: 7", "") + " next_event_seq: 7"
    write("state_log", "legacy-state-pb", [b"\x02" + encode("Snapshot", snapshot)])


if __name__ == "__main__":
    main()
