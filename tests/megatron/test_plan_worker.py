"""The plan worker process (``megatron/plan_worker.py``): its plans are the plans this process would
compile (hash, window plans cached under ``compile_on_layout``'s keys), compile errors come back as
themselves, and a worker that cannot start or dies leaves the run going in-process, said once."""

from __future__ import annotations

import io
import os
import pickle
import signal
import subprocess
import sys
import threading

import pytest

from megatron_hsap.errors import BatchError, ConfigError, HSAPError
from megatron_hsap.megatron import plan_worker
from megatron_hsap.megatron.plan_worker import PlanRequest, PlanWorker, compile_request
from megatron_hsap.plan import clear_plan_cache
from megatron_hsap.plan.workloads import pack_batches

KW = dict(inter_size=2, intra_size=2, num_heads=8, num_kv_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def worker():
    with PlanWorker() as w:
        yield w


def _requests(n: int = 3, seed: int = 5) -> list[PlanRequest]:
    return [PlanRequest(cu, dict(KW)) for cu in pack_batches("fineweb", 8192, n, seed)]


def test_worker_plans_are_this_process_plans(worker: PlanWorker) -> None:
    for req in _requests():
        got, seconds, in_worker = worker.compile(req)
        clear_plan_cache()
        want, _ = compile_request(req)
        assert got is not want and got.hash == want.hash  # compiled there, the same programs
        assert got.layout.segments == want.layout.segments and seconds > 0 and in_worker
    assert worker.pid is not None and worker.pid != os.getpid() and not worker.in_process


def test_window_plans_come_back_cached_under_their_layout_keys(worker: PlanWorker, monkeypatch) -> None:
    from megatron_hsap.plan import plan as plan_module
    from megatron_hsap.plan.shared_layout import compile_on_layout

    req = PlanRequest([0, 700, 1500, 1536, 4096], dict(KW), (None, (64, 0), (256, 0)))
    clear_plan_cache()
    want_base, want = compile_request(req)
    clear_plan_cache()
    plan = worker.compile(req).plan
    assert plan.hash == want_base.hash
    # the core attention of a windowed layer asks this process's cache: nothing may compile here
    monkeypatch.setattr(plan_module, "_compile_on", lambda *a: pytest.fail("a window plan was compiled in-process"))
    for window, ref in zip(req.windows, want):
        got = compile_on_layout(plan, window)
        assert got.hash == ref.hash and got.options.window_size == ref.options.window_size
        assert got.layout.segments == plan.layout.segments
    assert compile_on_layout(plan, None) is plan


def test_compile_errors_come_back_as_themselves(worker: PlanWorker) -> None:
    with pytest.raises(BatchError, match="non-decreasing") as got:
        worker.compile(PlanRequest([0, 5, 3], dict(KW)))
    assert any("plan worker process" in n for n in got.value.__notes__)
    with pytest.raises(ConfigError, match="num_heads"):
        worker.compile(PlanRequest([0, 64], dict(KW, num_heads=7)))
    assert not worker.in_process  # an error of the batch is not a failure of the worker
    plan = worker.compile(_requests(1, seed=9)[0]).plan
    assert plan.cp_size == 4  # (the worker goes on serving)


class _Unpicklable(HSAPError):
    def __init__(self, a: int, b: int) -> None:  # pickles as (message,): cannot be rebuilt
        super().__init__(f"{a}/{b}")


def test_an_error_that_does_not_survive_pickling_is_sent_as_text() -> None:
    reply = plan_worker._error_reply(_Unpicklable(1, 2))
    assert reply[0] == "error-text" and reply[1].endswith("_Unpicklable") and reply[2] == "1/2"
    assert plan_worker._error_reply(BatchError("x"))[0] == "error"


def test_serve_answers_each_request_in_order_until_end_of_stream() -> None:
    reqs = _requests(2, seed=11) + [PlanRequest([0, 9, 4], dict(KW))]
    inp = io.BytesIO()
    for r in reqs:
        plan_worker._write(inp, r)
    inp.seek(0)
    out = io.BytesIO()
    plan_worker.serve(inp, out)  # returns at the end of the request stream
    out.seek(0)
    replies = []
    while (data := plan_worker._read(out)) is not None:
        replies.append(pickle.loads(data))
    assert [r[0] for r in replies] == ["ok", "ok", "error"]
    for reply, req in zip(replies, reqs):
        if reply[0] == "ok":
            clear_plan_cache()
            assert reply[1].hash == compile_request(req)[0].hash and reply[2] == ()
    assert isinstance(replies[2][1], BatchError)
    assert plan_worker._read(io.BytesIO(b"\x05\x00")) is None  # a torn header is the end


def test_the_worker_outlives_a_ctrl_c_its_parent_decides_on(worker: PlanWorker) -> None:
    import time

    req = _requests(1, seed=29)[0]
    worker.compile(req)
    os.kill(worker.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends the whole process group
    time.sleep(0.2)  # (for the signal's delivery; the assertion below does not depend on timing)
    clear_plan_cache()
    plan = worker.compile(_requests(1, seed=31)[0]).plan
    assert not worker.in_process and worker._proc.poll() is None and plan.cp_size == 4


def test_a_killed_worker_leaves_the_run_compiling_in_process(capfd) -> None:
    reqs = _requests(2, seed=13)
    with PlanWorker() as w:
        first = w.compile(reqs[0]).plan
        os.kill(w.pid, signal.SIGKILL)
        got, _, in_worker = w.compile(reqs[1])  # the pipe is dead: compiled here, said once
        assert not in_worker
        assert w.in_process and w.pid is None and "exit status -9" in w.failure
        clear_plan_cache()
        assert got.hash == compile_request(reqs[1])[0].hash
        again = w.compile(reqs[0]).plan
    err = capfd.readouterr().err
    assert err.count("plan worker process:") == 1 and "--no-hsap-plan-process" in err
    assert again.hash == first.hash


def test_a_worker_that_exits_before_replying_or_cannot_start(monkeypatch, capfd) -> None:
    monkeypatch.setattr(plan_worker, "_CHILD", "import sys; sys.exit(3)")
    req = _requests(1, seed=17)[0]
    with PlanWorker() as w:
        plan = w.compile(req).plan
        assert w.in_process and "closed its pipe before replying; exit status 3" in w.failure
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with PlanWorker() as w:
        again = w.compile(req).plan
        assert w.in_process and "starting it failed" in w.failure
    assert again.hash == plan.hash
    assert capfd.readouterr().err.count("compiling plans in the training process from now on") == 2


def test_a_print_in_the_child_goes_to_stderr_not_into_the_replies(monkeypatch, capfd) -> None:
    noisy = ("import megatron_hsap.megatron.plan_worker as w; real = w.compile_request; "
             "w.compile_request = lambda r: (print('noise from the planner'), real(r))[1]; w.serve()")
    monkeypatch.setattr(plan_worker, "_CHILD", noisy)
    req = _requests(1, seed=37)[0]
    with PlanWorker() as w:
        plan = w.compile(req).plan
        assert not w.in_process
    clear_plan_cache()
    assert plan.hash == compile_request(req)[0].hash
    assert "noise from the planner" in capfd.readouterr().err


def test_disabled_compiles_in_process_and_starts_nothing() -> None:
    w = PlanWorker(enabled=False)
    plan, _, in_worker = w.compile(_requests(1, seed=19)[0])
    assert not in_worker
    assert w.in_process and w.pid is None and w.failure is None and plan.cp_size == 4
    w.close()


def test_close_stops_the_child_while_another_process_holds_its_pipe() -> None:
    # a process forked after the worker started (a DataLoader worker) holds a copy of the write end
    # of the child's stdin: closing ours is no end of stream, so close() must tell it to stop
    w = PlanWorker()
    w.compile(_requests(1, seed=31)[0])
    proc = w._proc
    assert proc is not None and proc.stdin is not None
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdin=subprocess.DEVNULL,
                              pass_fds=(proc.stdin.fileno(),))
    try:
        w.close()
        assert proc.returncode == 0  # it left on the stop message (killed after the wait: -9)
    finally:
        holder.kill()
        holder.wait()


def test_close_ends_the_child_and_callers_share_it_in_turn() -> None:
    reqs = _requests(4, seed=23)
    w = PlanWorker()
    out: dict[int, int] = {}

    def ask(i: int) -> None:
        out[i] = w.compile(reqs[i])[0].hash

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    proc = w._proc
    w.close()
    assert proc is not None and proc.returncode == 0  # it left at the end of its stdin
    again = w.compile(reqs[0])  # a closed worker starts a new process when asked again
    assert again.in_worker and w.pid not in (None, proc.pid) and again.plan.hash == out[0]
    w.close()
    for i, req in enumerate(reqs):
        clear_plan_cache()
        assert out[i] == compile_request(req)[0].hash
