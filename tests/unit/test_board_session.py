"""Where a job's lines begin on the run's board (pretrain/supervision/nodes.py `session`), on hand-written boards: a
node that joins late reads back to its peers' first "joined" line, and never into an earlier job's lines."""
import json

from pretrain.supervision.nodes import session


def board(*lines):
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    starts, at = [], 0
    for raw in data.splitlines(keepends=True):
        starts.append(at)
        at += len(raw)
    return data, starts


def joined(node, id, job="7.0."):
    return {"event": "joined", "node": node, "id": id, "job": job, "mark": {"rank0.exits.jsonl": len(id)}}


EARLIER = [joined(0, "a", "6.0."), joined(1, "b", "6.0."), {"event": "failed", "rank": 3},
           {"event": "ended", "node": 1, "status": 1}]   # an earlier job, its supervisors killed (no "closed")


def test_a_late_node_reads_back_to_its_peer_s_first_line_and_takes_its_mark():
    data, at = board(*EARLIER, {"event": "ended", "node": 0, "status": 1}, joined(0, "p"),
                     {"event": "failed", "rank": 1}, {"event": "ended", "node": 0, "status": 1}, joined(1, "me"))
    start, first = session(data, "me", 1, 2)
    assert (start, first["id"], first["mark"]) == (at[5], "p", {"rank0.exits.jsonl": 1})


def test_the_first_node_does_not_read_an_earlier_job_s_lines():
    data, at = board(*EARLIER, joined(0, "me"))
    assert session(data, "me", 0, 2) == (at[4], joined(0, "me"))
    data, at = board(*EARLIER, joined(1, "me"))   # the earlier job's node 1 wrote lines: its own stop it
    assert session(data, "me", 1, 2)[0] == at[4]


def test_a_closed_line_a_second_join_and_a_full_job_end_the_reading_back():
    closed = {"event": "closed", "node": 1}
    data, at = board(joined(0, "x", ""), closed, joined(0, "me", ""))
    assert session(data, "me", 0, 2)[0] == at[2]
    data, at = board(joined(2, "x"), joined(2, "y"), joined(0, "me"))
    assert session(data, "me", 0, 3)[0] == at[1]
    data, at = board(joined(2, "x"), joined(1, "y"), joined(0, "me"))
    assert session(data, "me", 0, 2)[0] == at[1]
    data, at = board(joined(2, "x"), joined(1, "y"), joined(0, "me"))
    assert session(data, "me", 0, 3)[0] == at[0]


def test_a_line_run_into_another_reads_from_the_end():
    data, _ = board(joined(0, "x"))
    assert session(data + b'{"event": "joi{"event"\n', "me", 1, 2) == (len(data) + 23, {})
