"""The engine's intra-op CPU threads fitted to the idle cores (issue 38): the count it would take,
the two-look rule, the ``/proc`` readings it is made of, and the settings it applies on the
engine thread (not the caller's)."""

from __future__ import annotations


import pytest
import torch

from lazyattn_rag.engine import cpu_threads
from lazyattn_rag.engine.cpu_threads import CpuThreads, fitted_threads, own_running_threads, running_threads


@pytest.mark.parametrize("cores, others, max_threads, expected", [
    (2, 0, 2, 2), (2, 1, 2, 1), (2, 5, 2, 1), (16, 3, 16, 13), (16, 0, 4, 4), (16, 3, 8, 8), (1, 0, 1, 1)])
def test_the_idle_cores_at_least_one_at_most_the_start(cores, others, max_threads, expected):
    assert fitted_threads(cores, others, max_threads) == expected


def test_a_change_takes_two_agreeing_looks_an_interval_apart():
    busy, count, sets = [1], [2], []

    def set_threads(n):
        sets.append(n)
        count[0] = n

    fit = CpuThreads(2, interval_s=1.0, cores=2, others=lambda: busy[0], set_threads=set_threads,
                     get_threads=lambda: count[0])
    fit.maybe_fit(now=0.0)
    assert sets == []  # one look: pending
    fit.maybe_fit(now=0.5)
    assert sets == []  # not due
    fit.maybe_fit(now=1.0)
    assert sets == [1] and fit.num_changes == 1
    busy[0] = 0  # the other job ended: a blip, then back
    fit.maybe_fit(now=2.0)
    busy[0] = 1
    fit.maybe_fit(now=3.0)
    assert sets == [1]  # the look that saw 2 was not confirmed
    busy[0] = 0
    fit.maybe_fit(now=4.0)
    fit.maybe_fit(now=5.0)
    assert sets == [1, 2] and count == [2]


def test_proc_readings(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nctxt 99\nprocs_running 7\nprocs_blocked 0\n")
    assert running_threads(str(stat)) == 7
    assert running_threads(str(tmp_path / "missing")) is None
    for tid, comm, state in (("1", "python", "R"), ("2", "a) R (b", "S"), ("3", "omp worker", "R"), ("4", "x", "D")):
        (tmp_path / "task" / tid).mkdir(parents=True)
        (tmp_path / "task" / tid / "stat").write_text(f"{tid} ({comm}) {state} 1 2 3 4\n")
    assert own_running_threads(str(tmp_path / "task")) == 2
    assert own_running_threads() >= 1  # this thread, reading


def test_the_engine_fits_its_own_threads_and_leaves_the_callers(make_llm, monkeypatch):
    caller = torch.get_num_threads()
    _, llm = make_llm()
    fit = llm.client.call(lambda engine: engine.cpu_threads)
    # at most the count the process had before any engine changed it (another test's may have)
    assert isinstance(fit, CpuThreads) and fit.max_threads == cpu_threads._START_THREADS >= 1

    def look_twice(engine):
        engine.cpu_threads._others = lambda: 64  # a machine full of other work
        engine.cpu_threads.cores = 2
        engine.cpu_threads.maybe_fit(now=1e9)
        engine.cpu_threads.maybe_fit(now=2e9)
        return torch.get_num_threads()

    assert llm.client.call(look_twice) == 1
    assert torch.get_num_threads() == caller  # OpenMP's count is the engine thread's own
    assert llm.generate("w5 w6", [], documents=[("d", "w1 w2 w3")]).text is not None

    def quiet_again(engine):
        engine.cpu_threads._others = lambda: 0
        engine.cpu_threads.maybe_fit(now=3e9)
        engine.cpu_threads.maybe_fit(now=4e9)
        return torch.get_num_threads()

    assert llm.client.call(quiet_again) == min(fit.max_threads, 2)


def test_a_fixed_count_is_set_on_the_engine_thread(make_llm):
    caller = torch.get_num_threads()
    _, llm = make_llm(cpu_threads=1)
    assert llm.client.call(lambda engine: (engine.cpu_threads, torch.get_num_threads())) == (None, 1)
    assert torch.get_num_threads() == caller
    with pytest.raises(ValueError, match="cpu_threads must be an integer >= 1"):
        make_llm(cpu_threads=0)
