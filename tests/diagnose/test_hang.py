"""Reading a stalled job: flight records (real gloo dumps) and faulthandler stacks."""

import json
import pickle
from pathlib import Path

import pytest

import nbgpu.rank.worker
from nbgpu.diagnose import diagnose
from nbgpu.diagnose.hang import (
    Frame,
    RankPlace,
    find_stall,
    main_thread,
    parse_stacks,
    read_trace,
)

FLIGHT = Path(__file__).parent / "flight"
SECOND = 10**9


def _dumps(name):
    return {r: read_trace((FLIGHT / f"{name}-rank{r}.json").read_bytes()) for r in (0, 1)}


def _now(traces, after_s=5):
    newest = max(e["time_created_ns"] for t in traces.values() for e in t["entries"])
    return newest + after_s * SECOND


def _entry(seq, *, op="all_reduce", sizes=((16,),), done=True, group="0", created=1):
    return {
        "collective_seq_id": seq,
        "profiling_name": f"gloo:{op}",
        "input_sizes": [list(s) for s in sizes],
        "retired": done,
        "process_group": [group, "default_pg" if group == "0" else "sub"],
        "time_created_ns": created * SECOND,
        "is_p2p": False,
    }


def test_a_rank_in_a_barrier_while_the_other_all_reduces():
    traces = _dumps("barrier")  # two real gloo ranks: rank 1 called barrier, rank 0 all_reduce
    stall = find_stall(traces, now_ns=_now(traces), world=[0, 1])
    assert stall is not None
    assert stall.lines() == [
        "stalled 5 s in all_reduce #4 [1000] (rank 0 waiting)",
        "rank 1 entered barrier #4 instead",
    ]
    assert stall.to_dict()["entered_other"] == {"1": {"op": "barrier", "seq": 4, "sizes": []}}


def test_same_op_other_kind_is_named_with_its_sizes():
    traces = _dumps("bcast")
    stall = find_stall(traces, now_ns=_now(traces), world=[0, 1])
    assert stall.lines()[1] == "rank 1 entered broadcast #4 [1000] instead"


def test_a_rank_that_never_entered_and_one_that_never_answered():
    traces = {
        0: {"entries": [_entry(1), _entry(2, done=False, created=3)]},
        1: {"entries": [_entry(1), _entry(2, done=False, created=4)]},
        2: {"entries": [_entry(1)]},  # still before collective 2
    }
    stall = find_stall(traces, now_ns=123 * SECOND, world=[0, 1, 2, 3])
    assert stall.waiting == [0, 1]
    assert stall.absent == {2: 1}
    assert stall.unanswered == [3]
    assert stall.waited_s == 120
    assert stall.lines() == [
        "stalled 2 min in all_reduce #2 [16] (ranks 0,1 waiting)",
        "rank 2 never entered it",
        "rank 3 gave no flight record (stopped, or native code holds it)",
    ]


def test_different_sizes_are_a_different_collective():
    traces = {
        0: {"entries": [_entry(7, sizes=((16,),), done=False)]},
        1: {"entries": [_entry(7, sizes=((16,),), done=False)]},
        2: {"entries": [_entry(7, sizes=((8,),), done=False)]},
    }
    stall = find_stall(traces, now_ns=10 * SECOND)
    assert stall.waiting == [0, 1]
    assert stall.lines()[1] == "rank 2 entered all_reduce #7 [8] instead"


def test_every_rank_inside_means_the_transport_not_the_code():
    traces = {r: {"entries": [_entry(3, done=False)]} for r in range(4)}
    stall = find_stall(traces, now_ns=100 * SECOND)
    assert stall.culprits == []
    assert "transport is stuck" in stall.lines()[1]


def test_a_sub_group_counts_only_its_members():
    traces = {
        0: {"entries": [_entry(5), _entry(1, group="3", done=False)]},
        1: {"entries": [_entry(5), _entry(1, group="3", done=False)]},
        2: {"entries": [_entry(5)]},  # not in group 3: neither waiting nor absent
        3: {"entries": [_entry(5)]},
    }
    stall = find_stall(traces, now_ns=100 * SECOND, world=[0, 1, 2, 3])
    assert stall.waiting == [0, 1]
    assert stall.culprits == []


def test_no_pending_collective_is_no_stall():
    traces = {r: {"entries": [_entry(1), _entry(2)]} for r in range(2)}
    assert find_stall(traces, now_ns=100 * SECOND) is None
    assert find_stall({0: {}, 1: {}}, now_ns=0) is None


def test_nccl_pickle_dumps_are_read_and_never_run_code():
    plain = {"entries": [_entry(1, done=False)], "version": "2.10"}
    assert read_trace(pickle.dumps(plain)) == plain

    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    with pytest.raises(ValueError, match="not a flight-recorder dump"):
        read_trace(pickle.dumps({"entries": Payload()}))
    with pytest.raises(ValueError, match="not a flight-recorder dump"):
        read_trace(b"\x80\x04truncated")
    with pytest.raises(ValueError, match="no table"):
        read_trace(json.dumps([1, 2]).encode())


STACKS = """\
Thread 0x00007f4eb75286c0 (most recent call first):
  File "/usr/lib/python3.11/socket.py", line 294 in accept
  File "/usr/lib/python3.11/threading.py", line 982 in run
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f4ed75dbb80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1291 in _try_get_data
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 725 in __next__
  File "/home/me/train.py", line 9 in load_batch
  File "/home/me/train.py", line 15 in <module>
"""


def test_faulthandler_stacks_main_thread_and_the_call_it_is_in():
    stacks = parse_stacks(STACKS)
    assert len(stacks) == 2
    main = main_thread(stacks)
    assert main[2] == Frame("/home/me/train.py", 9, "load_batch")
    assert RankPlace(main).words() == (
        "train.py:9 load_batch() → torch.utils.data.dataloader._try_get_data"
    )


def test_a_rank_in_its_own_code_shows_the_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import time\n\ndef load_batch():\n    time.sleep(600)\n")
    place = RankPlace((Frame(str(script), 4, "load_batch"), Frame(str(script), 9, "<module>")))
    assert place.words() == "train.py:4 load_batch(): time.sleep(600)"
    worker = (Frame(str(script), 4, "load_batch"),)
    both = RankPlace(main_thread(parse_stacks(STACKS)), worker).words()
    assert both.endswith("; its DataLoader worker is in train.py:4 load_batch(): time.sleep(600)")


def _nccl_dumps(directory):
    """The real gloo dumps, written as NCCL writes its dump on a timeout (a pickle each)."""
    for rank, trace in _dumps("barrier").items():
        (directory / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(trace))


def test_diagnose_reads_the_flight_records_nccl_leaves(tmp_path):
    _nccl_dumps(tmp_path)
    for source in (tmp_path, tmp_path / "nccl_trace_rank_1"):  # the folder, or one dump
        result = diagnose(source)
        assert result.cause == "stalled_collective", result.text()
        assert result.failed_rank == 1
        assert [e.text for e in result.root.evidence] == [
            "stalled in all_reduce #4 [1000] (rank 0 waiting)",
            "rank 1 entered barrier #4 instead",
        ]


def test_the_evidence_names_the_record_it_came_from(tmp_path):
    # A stall.json cut short (the kernel died while writing it): the dumps tell the stall.
    _nccl_dumps(tmp_path)
    (tmp_path / "stall.json").write_text('{"lines": ["stalled')
    sources = {e.source for e in diagnose(tmp_path).root.evidence}
    assert sources == {"flight recorder"}


def test_an_unreadable_dump_is_a_note_not_a_traceback(tmp_path):
    _nccl_dumps(tmp_path)
    (tmp_path / "nccl_trace_rank_2").write_bytes(b"\x80\x04garbage")
    result = diagnose(tmp_path)
    assert result.cause == "stalled_collective"
    assert any("nccl_trace_rank_2: not read as a flight record" in n for n in result.notes)


TIMEOUT_LOG = (Path(__file__).parent / "corpus/nccl_timeout/basicsr_737_allreduce.log").read_text()


def _stalled_run(directory, log):
    (directory / "rank0.log").write_text(log)
    lines = ["stalled 5 min in all_reduce #808 (ranks 0,2 waiting)", "rank 1 never entered it"]
    stall = {"lines": lines, "never_entered": {"1": 807}, "entered_other": {}}
    (directory / "stall.json").write_text(json.dumps(stall))


def test_a_recorded_stall_explains_the_timeouts_it_caused(tmp_path):
    _stalled_run(tmp_path, TIMEOUT_LOG)
    result = diagnose(tmp_path)
    assert result.cause == "stalled_collective", result.text()
    assert result.failed_rank == 1
    assert {f.cause: f.role for f in result.findings}["nccl_timeout"] == "consequence"


def test_a_crash_stays_the_root_of_the_stall_it_caused(tmp_path):
    oom = "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    _stalled_run(tmp_path, TIMEOUT_LOG + oom)
    result = diagnose(tmp_path)
    assert result.cause == "cuda_oom", result.text()
    assert {f.cause: f.role for f in result.findings}["stalled_collective"] == "also"


def test_a_cell_under_nbgpus_runs_directory_is_the_users_code():
    # Run directories live under ~/.cache/nbgpu/runs: "nbgpu" in a path is not nbgpu's code.
    cell = Frame("/home/me/.cache/nbgpu/runs/stuck-20261126-1120/cell.py", 14, "load_batch")
    assert not cell.library
    assert Frame("<frozen runpy>", 88, "_run_code").library
    assert Frame(nbgpu.rank.worker.__file__, 140, "main").library
