"""The Ray application's release log (serve/releases.py): what each replica reads of it."""

from __future__ import annotations

from prefixkv.serve.releases import ReleaseLog, log_name


def test_each_reader_gets_what_is_new_since_its_last_look():
    log = ReleaseLog()
    assert log.since(None, 0) == (log.log_id, 0, [])
    assert log.append(["resp_a", "resp_b"]) == 2
    lid, end, handles = log.since(None, 0)
    assert (lid, end, handles) == (log.log_id, 2, ["resp_a", "resp_b"])
    assert log.since(lid, 2) == (lid, 2, [])
    log.append(["resp_c"])
    assert log.since(lid, 2) == (lid, 3, ["resp_c"])
    assert log.since(lid, 1) == (lid, 3, ["resp_b", "resp_c"])


def test_a_new_log_or_a_trimmed_one_is_read_from_what_it_keeps():
    log = ReleaseLog(keep=3)
    log.append([f"r{i}" for i in range(5)])
    assert log.since(None, 0)[1:] == (5, ["r2", "r3", "r4"])  # a new reader: what is kept
    assert log.since(log.log_id, 1)[1:] == (5, ["r2", "r3", "r4"])  # fell behind the trim
    assert log.since(log.log_id, 4)[1:] == (5, ["r4"])
    other = ReleaseLog()  # the log of an earlier ingress: this one is read from its start
    assert log.since(other.log_id, 5)[1:] == (5, ["r2", "r3", "r4"])
    assert log_name("prefixkv") == "prefixkv-releases-prefixkv"
