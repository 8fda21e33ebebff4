"""The Megatron glue's side of faults: the pack check it builds (megatron/iterator.py) and how a
balanced job's ranks say where they stood when it stops (megatron/stops.py)."""
import os
import signal
import subprocess
import sys
import textwrap

from megatron_mm_balance.megatron.stops import StopReporter, error_line, stopped_line
from megatron_mm_balance.runtime.errors import PeerFailure, add_context

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_error_line_names_rank_iteration_and_the_runtime_context():
    e = add_context(ValueError("shard 7 unreadable\nsecond line"), "rank 1, global batch 2 (iteration 5), "
                                                                   "micro-step 1: the data source raised")
    assert error_line(e, 1, 5) == ("[mm-balance] rank 1: training stops at iteration 5: ValueError: shard 7 "
                                   "unreadable | rank 1, global batch 2 (iteration 5), micro-step 1: the data "
                                   "source raised")
    assert error_line(PeerFailure("rank 0: x"), 0, None) == ("[mm-balance] rank 0: training stops before the "
                                                             "first iteration: PeerFailure: rank 0: x")
    assert stopped_line(3, "SIGTERM", 4, ["global batch 1 (iteration 4), 1 of 2 micro-steps delivered", ""]) == (
        "[mm-balance] rank 3: stopped by SIGTERM at iteration 4: global batch 1 (iteration 4), 1 of 2 "
        "micro-steps delivered")


def test_an_error_is_reported_once(capsys):
    rep = StopReporter(lambda: 7, rank=2)
    e = RuntimeError("boom")
    rep.error(e)
    rep.error(e)
    err = capsys.readouterr().err
    assert err == "[mm-balance] rank 2: training stops at iteration 7: RuntimeError: boom\n"


def test_sigterm_prints_where_each_iterator_stood_then_ends_the_process_as_before():
    """In a child process: the report on SIGTERM, then Python's default disposition (exit -15);
    a handler installed before ours is called instead of the default; an uncaught exception
    (not one of the balanced iterator's, already reported) is reported, then the traceback."""
    code = textwrap.dedent("""
        import os, signal, sys, time
        from megatron_mm_balance.megatron.stops import StopReporter
        class It:
            def position(self):
                return "global batch 1 (iteration 4), 1 of 2 micro-steps delivered; exchange: receiving"
        if sys.argv[1] == "chained":
            signal.signal(signal.SIGTERM, lambda *a: (print("previous handler", flush=True), sys.exit(5)))
        it = It()
        StopReporter(lambda: 4, rank=3).watch(it)
        if sys.argv[1] == "uncaught":
            raise RuntimeError("gloo: connection closed by peer")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("not reached")
    """)
    env = dict(os.environ, PYTHONPATH=REPO)
    res = subprocess.run([sys.executable, "-c", code, "default"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert res.returncode == -signal.SIGTERM, (res.returncode, res.stderr)
    assert res.stderr.strip().endswith("[mm-balance] rank 3: stopped by SIGTERM at iteration 4: global batch 1 "
                                       "(iteration 4), 1 of 2 micro-steps delivered; exchange: receiving")
    assert "not reached" not in res.stdout
    res = subprocess.run([sys.executable, "-c", code, "chained"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert res.returncode == 5 and "previous handler" in res.stdout, (res.returncode, res.stdout, res.stderr)
    assert "stopped by SIGTERM at iteration 4" in res.stderr
    res = subprocess.run([sys.executable, "-c", code, "uncaught"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert res.returncode == 1, (res.returncode, res.stderr)
    first, rest = res.stderr.split("\n", 1)
    assert first == ("[mm-balance] rank 3: stopped by RuntimeError: gloo: connection closed by peer at "
                     "iteration 4: global batch 1 (iteration 4), 1 of 2 micro-steps delivered; exchange: receiving")
    assert rest.startswith("Traceback") and "connection closed by peer" in rest


def test_the_pack_check_takes_the_sequence_length_and_the_models_image_token_index():
    """``--decoder-seq-length`` (else ``--seq-length``) bounds a packed sample; the placeholder id
    is the one LLaVA splits images by, found on the model chunks (not counted without a model)."""
    import types

    import torch

    from megatron_mm_balance.megatron.config import MegatronArgs
    from megatron_mm_balance.megatron.iterator import make_pack_check

    class Llava(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.image_token_index = 151665
            self.proj = torch.nn.Linear(2, 2)

    class Wrapped(torch.nn.Module):                  # DDP(Float16Module(LLaVAModel)) in Megatron
        def __init__(self):
            super().__init__()
            self.module = Llava()

    cfg = types.SimpleNamespace(megatron=MegatronArgs.read(types.SimpleNamespace(seq_length=576,
                                                                                 decoder_seq_length=1024)))
    check = make_pack_check(cfg, [Wrapped()])
    assert (check.max_length, check.image_token_id) == (1024, 151665)
    cfg = types.SimpleNamespace(megatron=MegatronArgs.read(types.SimpleNamespace(seq_length=2048)))
    check = make_pack_check(cfg, None)
    assert (check.max_length, check.image_token_id) == (2048, None)
