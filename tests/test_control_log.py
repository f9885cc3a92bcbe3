"""The Ray application's control log (serve/control_log.py): what each replica reads of it."""

from __future__ import annotations

from prefixkv.serve.control_log import ControlLog, log_name


def test_each_reader_gets_what_is_new_since_its_last_look():
    log = ControlLog()
    assert log.since(None, 0) == (log.log_id, 0, [])
    assert log.append(["resp_a", "resp_b"]) == 2
    lid, end, handles = log.since(None, 0)
    assert (lid, end, handles) == (log.log_id, 2, ["resp_a", "resp_b"])
    assert log.since(lid, 2) == (lid, 2, [])
    log.append(["resp_c"])
    assert log.since(lid, 2) == (lid, 3, ["resp_c"])
    assert log.since(lid, 1) == (lid, 3, ["resp_b", "resp_c"])


def test_a_new_log_or_a_trimmed_one_is_read_from_what_it_keeps():
    log = ControlLog(keep=3)
    log.append([f"r{i}" for i in range(5)])
    assert log.since(None, 0)[1:] == (5, ["r2", "r3", "r4"])  # a new reader: what is kept
    assert log.since(log.log_id, 1)[1:] == (5, ["r2", "r3", "r4"])  # fell behind the trim
    assert log.since(log.log_id, 4)[1:] == (5, ["r4"])
    other = ControlLog()  # the log of an earlier ingress: this one is read from its start
    assert log.since(other.log_id, 5)[1:] == (5, ["r2", "r3", "r4"])
    assert log_name("prefixkv") == "prefixkv-control-prefixkv"


def test_resets_are_numbered_read_once_by_the_replicas_named_and_reported_per_replica():
    log = ControlLog()
    assert log.resets_since(None, 0, "replica-a") == (log.log_id, 0, [])
    assert log.ask_reset(["replica-a", "replica-b"]) == (log.log_id, 0)
    assert log.ask_reset(["replica-b"]) == (log.log_id, 1)
    lid, end, numbers = log.resets_since(None, 0, "replica-b")
    assert (lid, end, numbers) == (log.log_id, 2, [0, 1])
    assert log.resets_since(None, 0, "replica-a") == (lid, 2, [0])  # (1 does not name it)
    assert log.resets_since(None, 0, "replica-c") == (lid, 2, [])  # started since: not asked
    assert log.resets_since(lid, 2, "replica-b") == (lid, 2, [])
    assert log.resets_since(lid, 1, "replica-b") == (lid, 2, [1])
    assert log.reset_reports(lid, 0) == {}
    log.report_reset(0, "replica-a", True)
    log.report_reset(0, "replica-b", False)
    assert log.reset_reports(lid, 0) == {"replica-a": True, "replica-b": False} and log.reset_reports(lid, 1) == {}
    assert log.reset_reports(ControlLog().log_id, 0) is None  # asked of a log that is gone
    log.report_reset(7, "replica-a", True)  # never asked: nothing kept
    assert log.reset_reports(lid, 7) is None


def test_old_resets_are_trimmed_and_another_logs_position_reads_from_the_start():
    log = ControlLog(keep_resets=2)
    for _ in range(4):
        log.ask_reset(["replica-a"])
    assert log.resets_since(None, 0, "replica-a")[1:] == (4, [2, 3])  # the two kept
    log.report_reset(0, "replica-a", True)
    assert log.reset_reports(log.log_id, 0) is None
    assert log.resets_since(ControlLog().log_id, 4, "replica-a")[1:] == (4, [2, 3])
