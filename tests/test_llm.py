"""The offline façade on a tiny checkpoint with a tokenizer: text in, text out; and an engine of
rank processes that ends when it is shut down, dropped, or left behind at the interpreter's exit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from moeserve import LLM, SamplingParams
from moeserve.models.tiny import make_tiny_model
from tests.e2e.server_utils import alive, descendants


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "v3"), preset="v3", seed=0,
                           initializer_range=0.1)
    return LLM(path, dtype="float32", page_size=4, max_total_tokens=1024)


def test_text_prompts_and_token_id_prompts_agree(llm):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ids = llm.tokenizer.encode("The quick brown fox")
    by_text, by_ids = llm.generate(["The quick brown fox", ids], params, use_tqdm=False)
    assert by_text.prompt_token_ids == ids
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.text == llm.tokenizer.decode(by_text.token_ids)


def test_stop_string_cuts_the_text(llm):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    full = llm.generate(["abc"], params, use_tqdm=False)[0]
    stop = full.text[5:7]
    assert stop, "need some text to cut at"
    cut = llm.generate(["abc"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.find(stop)]
    assert full.token_ids[:len(cut.token_ids)] == cut.token_ids


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "What is 1+1?"}]
    out = llm.chat(messages, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    ids = llm.tokenizer.apply_chat_template(messages)
    assert out.prompt_token_ids == ids and len(out.token_ids) == 6


def test_eos_ends_generation_unless_ignored(llm):
    assert llm.tokenizer.eos_token_id in llm.scheduler.eos_token_ids
    prompt = llm.tokenizer.encode("hello")
    free = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    eos_like = free.token_ids[2]
    saved = llm.scheduler.eos_token_ids
    llm.scheduler.eos_token_ids = frozenset({eos_like})  # pretend the model's eos is that token
    try:
        stopped = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0]
        ignored = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                               use_tqdm=False)[0]
    finally:
        llm.scheduler.eos_token_ids = saved
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:free.token_ids.index(eos_like) + 1]
    assert stopped.text == llm.tokenizer.decode(stopped.token_ids[:-1])
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_unknown_setting_is_refused(tmp_path):
    path = make_tiny_model(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="page_sise"):
        LLM(path, page_sise=4)


def test_sharded_checkpoint_gives_the_same_tokens(tmp_path):
    single = make_tiny_model(str(tmp_path / "single"), preset="v2-lite", seed=5, initializer_range=0.1)
    sharded = make_tiny_model(str(tmp_path / "sharded"), preset="v2-lite", seed=5, initializer_range=0.1,
                              shard_size_mb=0.05)
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = [LLM(p, dtype="float32", max_total_tokens=256).generate(["shards"], params, use_tqdm=False)[0]
            for p in (single, sharded)]
    assert outs[0].token_ids == outs[1].token_ids


# ---- an engine of two rank processes: nothing outlives it, nothing hangs on it -----------------------
START_TIMEOUT_S = 300  # a tp_size=2 engine starting on a busy 2-core machine
DROP_TIMEOUT_S = 30  # the finalizer's waits are bounded (RankProcesses.stop, ServerSide.close)
EXIT_TIMEOUT_S = 10
TWO_RANKS = {"tp_size": 2, "device": "cpu", "dtype": "float32", "max_total_tokens": 256}
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

# The reported hang: ``del llm`` waited forever in the ZMQ context's end (its ZAP handler still ran)
# while rank 0 blocked sending stats and rank 1 waited for it in a broadcast. Progress goes to a JSON
# file, so the test sees how far the script got whatever happens to it.
DROP_SCRIPT = f"""
import gc, json, os, sys, time
from moeserve import LLM, SamplingParams

def report(**fields):
    with open(sys.argv[2] + ".tmp", "w") as f:
        json.dump(fields, f)
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])

llm = LLM(sys.argv[1], **{TWO_RANKS!r})
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
procs = list(llm._ranks.ranks.procs)
pids = [p.pid for p in procs]
report(pids=pids)
start = time.monotonic()
del llm
gc.collect()
report(pids=pids, del_s=time.monotonic() - start, alive=[p.is_alive() for p in procs], end=time.time())
"""


@pytest.fixture(scope="module")
def small_path(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("small") / "v2"), preset="v2-lite", num_hidden_layers=2)


def _wait_for_report(proc: subprocess.Popen, path: str, key: str, timeout: float, log: str) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, ValueError):
            with open(path) as f:
                report = json.load(f)
            if key in report:
                return report
        if proc.poll() is not None:
            pytest.fail(f"the script exited with {proc.returncode} before reporting {key!r}:\n{_tail(log)}")
        time.sleep(0.1)
    pytest.fail(f"no {key!r} from the script within {timeout:.0f} s:\n{_tail(log)}")


def _tail(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-3000:]


def test_dropping_a_two_rank_llm_stops_its_ranks_and_lets_the_interpreter_exit(small_path, tmp_path):
    report_path, log_path = str(tmp_path / "report.json"), str(tmp_path / "log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", DROP_SCRIPT, small_path, report_path],
                                stdout=log, stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        pids = _wait_for_report(proc, report_path, "pids", START_TIMEOUT_S, log_path)["pids"]
        report = _wait_for_report(proc, report_path, "end", DROP_TIMEOUT_S, log_path)  # del llm returned
        assert report["alive"] == [False, False], "the finalizer waits for the ranks to end"
        assert not set(pids) & set(descendants(proc.pid))
        try:
            proc.wait(timeout=max(report["end"] + EXIT_TIMEOUT_S - time.time(), 0))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the interpreter did not exit within {EXIT_TIMEOUT_S} s of the script's end")
        assert proc.returncode == 0, _tail(log_path)
        assert not [pid for pid in pids if alive(pid)]
    finally:
        _kill_leftovers(proc, pids)  # a failed run leaves nothing behind either


def _kill_leftovers(proc: subprocess.Popen, rank_pids: list[int]) -> None:
    """Kill ``proc``'s process tree, and ranks of it that outlived it (only while they are still
    rank processes by name: a pid may have been reused)."""
    leftovers = descendants(proc.pid) if proc.poll() is None else []
    for pid in rank_pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/comm") as f:
            if f.read().startswith("moeserve-rank") and pid not in leftovers:
                leftovers.append(pid)
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.kill()  # nothing once it has exited
    proc.wait()


def test_shutdown_stops_the_ranks_once_and_then_generate_refuses(small_path):
    llm = LLM(small_path, **TWO_RANKS)
    procs = list(llm._ranks.ranks.procs)
    try:
        assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids) == 3
        llm.shutdown()
        assert not any(p.is_alive() for p in procs)
        llm.shutdown()  # again: nothing to do
        llm.close()
        with pytest.raises(RuntimeError, match="shut down"):
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
