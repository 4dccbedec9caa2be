"""Serving in llama.cpp (engines/serve.py, eval/llamacpp.py, inference/llama_server.py): the launcher measures a drafter
in llama-server and says when no block length pays, serves until Ctrl-C and leaves no server behind, refuses bad input
in one line; llama-server with each drafter family decodes as the target alone at T = 0. Needs the llama.cpp build."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama_config
from transformers import LlamaForCausalLM

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError, atomic_write_json
from specdrafter.engines.serve import has_confidence, main, plan_path, resolve_drafter
from specdrafter.eval.llamacpp import Calibration, Cut, first_difference, side_by_side
from specdrafter.export.formats import export
from specdrafter.inference.llama_server import LlamaServer, ServerDied, free_port
from specdrafter.kinds import KINDS

pytestmark = pytest.mark.skipif(not llamacpp.installed(), reason="llama.cpp is not built (specdrafter-llamacpp install)")


def refusal(argv) -> str:
    """The one line main() exits with (its SystemExit's message, which Python prints to stderr)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    line = str(e.value.code)
    assert line.startswith("error: ") and "\n" not in line
    return line


def test_a_random_head_is_measured_and_not_served_since_no_k_pays(capsys, drafter_run_of, quick_plan):
    """A random EAGLE-3 head accepts nothing: the plan says so, names the cause, and a rerun uses the cached plan."""
    run = drafter_run_of("eagle3", "drafter.eagle.draft_vocab_size=0")
    main([str(run), "--plan-only"])
    out = capsys.readouterr().out
    assert "measuring draft-eagle3 in llama.cpp" in out and "no k pays here" in out
    assert "served without the drafter" in out
    assert all(f"n_max {k}:" in out for k in (1, 2, 3, 4, 8)) and "n_max 5:" not in out  # c measured where plans pick
    main([str(run), "--plan-only"])
    again = capsys.readouterr().out
    assert "measuring" not in again and "no k pays here" in again


def default_signals() -> None:
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def start_serving(run: Path, port: int, log: Path) -> subprocess.Popen:
    """`specdrafter-serve RUN --k 2 --port PORT` as a job of its own, returned once its llama-server answers."""
    # its output goes to a file: an unread pipe fills up with the export's progress lines and blocks the job
    out = log.open("w")
    # Ctrl-C's and a hang-up's default dispositions in the job, as in a terminal: a suite started in the background of a
    # shell (`cmd &`) hands its children SIGINT ignored, one started under nohup SIGHUP, and the launcher rightly keeps
    # an ignored signal ignored (`nohup specdrafter-serve …` is meant to outlive its terminal)
    job = subprocess.Popen([sys.executable, "-m", "specdrafter.engines.serve", str(run), "--k", "2", "--port",
                            str(port)], stdout=out, stderr=subprocess.STDOUT, text=True, preexec_fn=default_signals)
    deadline = time.time() + 240
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return job
        except OSError:
            assert job.poll() is None, log.read_text()
            assert time.time() < deadline, "the server did not come up"
            time.sleep(0.5)


def servers_on(port: int) -> list:
    """The pids of the llama-server processes started with --port PORT (an exited one's cmdline reads empty)."""
    return [int(cmd.parent.name) for cmd in Path("/proc").glob("[0-9]*/cmdline")
            if "llama-server" in _reads(cmd) and f"--port\0{port}\0" in _reads(cmd)]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_server_runs_until_ctrl_c_and_none_is_left(drafter_run_of, tmp_path):
    port = free_port()
    job = start_serving(drafter_run_of("dspark"), port, tmp_path / "serve.log")
    job.send_signal(signal.SIGINT)
    assert job.wait(timeout=60) == 130, (tmp_path / "serve.log").read_text()[-2000:]
    assert not listening(port)  # nothing listens there any more
    assert servers_on(port) == []  # no llama-server process is left with that port
    # --k serves the drafter at that k, and says so
    assert "the drafter is served at k = 2 (--spec-draft-n-max 2), as --k asks" in (tmp_path / "serve.log").read_text()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGHUP])
def test_no_server_outlives_a_launcher_killed_or_hung_up(drafter_run_of, tmp_path, how):
    """`kill -9` of the launcher (no handler runs: the kernel's parent-death signal ends its server) and SIGHUP (a
    closed terminal: handled as SIGTERM) leave no llama-server and nothing listening on the port, within seconds."""
    port = free_port()
    job = start_serving(drafter_run_of("dspark"), port, tmp_path / "serve.log")
    started = servers_on(port)
    try:
        assert len(started) == 1
        job.send_signal(how)
        code = job.wait(timeout=60)
        deadline = time.time() + 5
        while (servers_on(port) or listening(port)) and time.time() < deadline:
            time.sleep(0.1)
        assert servers_on(port) == [] and not listening(port)
        assert code == (-signal.SIGKILL if how == signal.SIGKILL else 128 + signal.SIGHUP)  # SIGHUP: handled
    finally:
        for pid in servers_on(port):  # a server left behind (the defect) is not left to the next test
            os.kill(pid, signal.SIGKILL)


def _reads(cmdline: Path) -> str:
    try:
        return cmdline.read_text()
    except OSError:  # a process that ended while the folder was read
        return ""


def test_a_vllm_export_is_converted_as_the_export_it_is(capsys, tmp_path, drafter_run_of, gguf_target_dir):
    """A --format vllm export is what llama.cpp's converter reads: served as that folder (converted once, into the
    cache), never as its parent, and converted to the same GGUF as the checkpoint it was exported from."""
    run = drafter_run_of("eagle3", "drafter.eagle.draft_vocab_size=0")
    folder = export(run, "vllm", tmp_path / "exports" / "eagle3-vllm")
    main([str(folder), "--target-dir", str(gguf_target_dir), "--k", "2", "--plan-only"])
    out = capsys.readouterr().out
    assert f"converting the --format vllm export {folder} to GGUF" in out and f"{folder.parent} " not in out
    assert "the drafter would be served at k = 2 (--spec-draft-n-max 2), as --k asks (no plan measured) (--plan-only: " \
           "nothing is served now)" in out
    converted, trained = resolve_drafter(folder, gguf_target_dir), resolve_drafter(run)
    assert converted.spec_type == "draft-eagle3" and converted.facts["target_layers"] == [1, 3, 5]
    assert converted.facts["tensors"] == trained.facts["tensors"]
    main([str(folder), "--target-dir", str(gguf_target_dir), "--k", "2", "--plan-only"])
    assert "converting" not in capsys.readouterr().out  # once


def test_an_sglang_export_is_refused_naming_it(capsys, tmp_path, drafter_run_of):
    """SGLang's layer ids are ours − 1 and its EAGLE-3 folder has no top-level ids: llama.cpp's converter would read
    the head on the wrong layers. One line naming the folder given and what to pass instead."""
    folder = export(drafter_run_of("eagle3", "drafter.eagle.draft_vocab_size=0"), "sglang", tmp_path / "eagle3-sglang")
    assert refusal([str(folder), "--plan-only"]) == (
        f"error: '{folder}' is a --format sglang export of an EAGLE-3 head; llama.cpp's converter reads the --format "
        "vllm layout: pass the checkpoint it was exported from, or its --format vllm or --format gguf export")


def test_the_advice_names_the_setting_it_priced_and_what_plan_only_would_serve(capsys, drafter_run_of):
    """The best setting is a confidence cut that does not pay: the advice names it (k and p_min), not plain k, and
    --plan-only says what would be served. The plan is written to the cache as a measurement would be."""
    run = drafter_run_of("eagle3", "drafter.eagle.draft_vocab_size=0")
    drafter = resolve_drafter(run)
    target = llamacpp.target_gguf(drafter.target_folder)
    cal = Calibration("draft-eagle3", 8, {1: 0.5, 8: 4.0}, [0.4, 0.16, 0.06, 0.02, 0.01, 0, 0, 0],
                      {n: 1.0 + 0.1 * (n - 1) for n in range(1, 10)}, 0.02, 50.0, 1, 6, 64, [Cut(0.7, 1.3, 0.5, 1.3)])
    choice = cal.choose()
    assert (choice.k, choice.p_min, choice.pays) == (8, 0.7, False) and cal.predicted(1) < 0.9
    atomic_write_json(plan_path(drafter, target, 1), cal.to_json())
    main([str(run), "--plan-only"])
    out = capsys.readouterr().out
    assert "measuring" not in out
    assert ("no k pays here: the best, k = 8 with p_min 0.7 (--spec-draft-n-max 8 --spec-draft-p-min 0.7), is "
            "predicted 1.00×") in out
    assert "so the target would be served without the drafter (--plan-only: nothing is served now)" in out


@pytest.mark.parametrize("k", [0, 9])
def test_k_outside_the_block_is_one_line(capsys, drafter_run_of, k):
    line = refusal([str(drafter_run_of("dspark")), "--k", str(k), "--plan-only"])
    assert line == f"error: --k {k}: k must be between 1 and 4 (this draft-dspark drafter drafts at most 4 tokens a step)"


def test_a_port_in_use_is_one_line(capsys, drafter_run_of):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = refusal([str(drafter_run_of("dflash", "drafter.block.draft_vocab_size=0")), "--k", "2",
                                "--port", str(port)])
    assert line == f"error: port {port} is in use (another server?): choose another with --port"


def test_a_target_gguf_of_another_model_is_one_line(capsys, tmp_path, drafter_run_of, smollm2_tokenizer):
    torch.manual_seed(1)
    other = LlamaForCausalLM(tiny_llama_config(len(smollm2_tokenizer), num_hidden_layers=6, hidden_size=32))
    other.save_pretrained(tmp_path / "other")
    smollm2_tokenizer.save_pretrained(tmp_path / "other")
    line = refusal([str(drafter_run_of("eagle3", "drafter.eagle.draft_vocab_size=0")), "--k", "1",
                            "--target-gguf", str(llamacpp.target_gguf(tmp_path / "other")), "--plan-only"])
    assert line == ("error: the target GGUF is 32 wide and the drafter reads features 64 wide: not the target it was "
                    "trained for")


def test_a_kind_llamacpp_cannot_serve_is_one_line(capsys, drafter_run_of):
    line = refusal([str(drafter_run_of("medusa")), "--plan-only"])
    assert line.startswith("error: --format gguf: llama.cpp serves no drafter like")


GGUF_OF_ARCH = """
import sys, numpy as np, gguf
w = gguf.GGUFWriter(sys.argv[1], sys.argv[2])
w.add_block_count(1)
w.add_tensor(sys.argv[3], np.zeros((4, 8), dtype=np.float32))
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
"""


@pytest.mark.parametrize("arch, tensor", [("medusa", "heads.0.weight"), ("llama", "blk.0.attn_q.weight")])
def test_a_gguf_no_kind_declares_is_one_line(capsys, tmp_path, arch, tensor):
    """A GGUF whose architecture no kind's LlamaCpp record declares (a Medusa file; a causal LM without token
    embeddings) is refused in one line naming it, before any server starts."""
    path = tmp_path / f"{arch}.gguf"
    subprocess.run([sys.executable, "-c", GGUF_OF_ARCH, str(path), arch, tensor], env=llamacpp.converter_env(), check=True)
    line = refusal([str(path), "--plan-only"])
    assert line.startswith(f"error: '{path}' is a GGUF of architecture '{arch}', which no drafter kind llama.cpp serves")


def test_a_server_that_dies_mid_run_is_one_line(drafter_run_of):
    drafter = resolve_drafter(drafter_run_of("dspark"))
    with LlamaServer(llamacpp.target_gguf(drafter.target_folder)) as server:
        assert len(server.complete([100, 101, 102], 4)["tokens"]) == 4
        server.process.kill()
        server.process.wait()
        with pytest.raises(ServerDied, match=r"^llama-server died \(exit -9\)") as e:
            server.complete([100, 101, 102], 4)
        assert "\n" not in str(e.value)


def test_a_missing_gguf_is_one_line(tmp_path):
    with pytest.raises(SpecdrafterError, match="does not exist"):
        LlamaServer(tmp_path / "none.gguf").start()


@pytest.mark.parametrize("kind, extra", [("dflash", ["drafter.block.draft_vocab_size=0"]), ("draft_model", [])])
def test_each_family_decodes_in_llama_server_as_the_target_alone(drafter_run_of, kind, extra):
    """EAGLE-3 and DSpark are checked in test_gguf.py; here DFlash and a draft model, through the eval arm, which
    fails loudly on a departure at a clear margin. Random drafters: rejections and rollbacks run."""
    drafter = resolve_drafter(drafter_run_of(kind, *extra))
    prompts = [list(range(100 + 7 * i, 120 + 7 * i)) for i in range(3)]
    arm = side_by_side(llamacpp.target_gguf(drafter.target_folder), drafter.gguf, drafter.spec_type, 3, prompts, 24,
                       log=lambda _: None)
    assert arm.drafted > 0 and arm.identical + len(arm.departures) == 3
    assert all(d["tie"] for d in arm.departures)


def test_c_between_measured_block_lengths_is_on_their_line():
    cal = Calibration("draft-eagle3", 8, {1: 0.1, 2: 0.25, 3: 0.3, 4: 0.4, 8: 0.8}, [0.5] * 8, {1: 1.0}, 0.02, 50.0,
                      1, 6, 64)
    assert [cal.c_at(k) for k in (1, 2, 3, 4)] == [0.1, 0.25, 0.3, 0.4]  # measured, not read off a line
    assert cal.c_at(6) == pytest.approx(0.6)
    old = Calibration.from_json({**cal.to_json(), "c": {"1": 0.1, "8": 0.8}})  # a plan measured at 1 and K only
    assert old.c_at(2) == pytest.approx(0.2) and old.c_at(8) == 0.8


def test_the_plan_lets_idle_pools_sleep_only_where_that_step_is_cheaper_by_more_than_the_noise():
    """A step measured with --poll 0 --poll-draft 0 at the best k replaces the plain one only when cheaper beyond the
    noise; the choice's flags then carry it, and a plan read back from JSON keeps it."""
    cal = Calibration("draft-simple", 4, {1: 0.2, 2: 0.4, 3: 0.6, 4: 0.8}, [0.8, 0.6, 0.4, 0.2],
                      {n: 1.0 + 0.2 * (n - 1) for n in range(1, 6)}, 0.02, 50.0, 2, 6, 64)
    plain = cal.choose()
    assert not plain.pools_sleep and plain.extra() == []
    cal.sleeping = {plain.k: cal.step_cost(plain.k) * 0.99}  # within the noise: not worth a flag
    assert cal.choose() == plain
    cal.sleeping = {plain.k: cal.step_cost(plain.k) * 0.9}
    asleep = cal.choose()
    assert asleep.k == plain.k and asleep.pools_sleep and asleep.predicted == pytest.approx(plain.predicted / 0.9)
    assert asleep.flags() == f"--spec-draft-n-max {plain.k} --poll 0 --poll-draft 0"
    assert Calibration.from_json(json.loads(json.dumps(cal.to_json()))).choose() == asleep


def test_the_plan_takes_a_confidence_cut_only_where_it_beats_the_best_k_by_more_than_the_noise():
    cal = Calibration("draft-eagle3", 8, {1: 0.08, 8: 0.64}, [0.4, 0.16, 0.06, 0.02, 0.01, 0, 0, 0],
                      {n: 1.0 + 0.1 * (n - 1) for n in range(1, 10)}, 0.02, 50.0, 1, 6, 64)
    plain = cal.choose()
    assert plain.k == 1 and plain.p_min == 0 and plain.flags() == "--spec-draft-n-max 1"
    assert plain.predicted == pytest.approx(1.4 / 1.18)
    cal.cuts = [Cut(0.5, 1.0 + 0.1, 0.2, 1.0)]  # drafts little: slower than k = 1
    assert cal.choose() == plain
    cal.cuts.append(Cut(0.3, 1.6, 1.1, 1.2))  # 1.33× against 1.19×
    best = cal.choose()
    assert (best.k, best.p_min, best.pays) == (8, 0.3, True) and best.predicted == pytest.approx(1.6 / 1.2)
    assert best.flags() == "--spec-draft-n-max 8 --spec-draft-p-min 0.3"
    assert Calibration.from_json(json.loads(json.dumps(cal.to_json()))).choose() == best
    assert cal.step_cost(8, 0.3) == 1.2
    with pytest.raises(SpecdrafterError, match="no confidence cut at p_min 0.9"):
        cal.step_cost(8, 0.9)


def test_a_dspark_drafter_without_a_confidence_head_gets_no_cut(capsys, drafter_run_of):
    """llama-server refuses --spec-draft-p-min > 0 for a DSpark GGUF without a confidence head: the plan measures no
    cut for one, and --p-min is refused in one line."""
    run = drafter_run_of("dspark")
    drafter = resolve_drafter(run)
    assert drafter.spec_type == "draft-dspark" and has_confidence(drafter)  # ours always has one
    drafter.facts["fields"]["dflash.has_confidence_head"] = False  # as another trainer's GGUF may say
    assert not has_confidence(drafter)
    assert has_confidence(replace(drafter, kind=KINDS["dflash"]))  # DFlash cuts by its top probability


def test_p_min_without_k_is_one_line(capsys, tmp_path):
    assert "given with --k" in refusal([str(tmp_path), "--p-min", "0.5"])


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2
