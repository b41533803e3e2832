"""The Flax LM example: data, exact resume after SIGKILL, corrupted checkpoints."""

import dataclasses
import json
import logging
import pathlib
import platform
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import optax_muon as om
from conftest import ROOT
from examples.flax_lm import checkpoint as checkpoint_lib
from examples.flax_lm import compare as compare_lib
from examples.flax_lm import config as config_lib
from examples.flax_lm import distributed
from examples.flax_lm import qk_clip_demo
from examples.flax_lm import runs as runs_lib
from examples.flax_lm import train as train_lib
from examples.flax_lm.data import ByteCorpus

SMALL = [
  "model.n_layer=1",
  "model.n_embd=32",
  "model.n_head=2",
  "model.block_size=32",
  "train.batch_size=4",
  "train.steps=12",
  "train.warmup_steps=2",
  "train.eval_every=4",
  "train.eval_batches=1",
  "train.log_every=1",
  "train.max_bytes=200000",
  "train.progress=false",
]


def _run_in_subprocess(overrides, kill_at_step=None, resume=False):
  """Runs train.main in a fresh process; optionally SIGKILLs it mid-run."""
  script = textwrap.dedent(f"""
      import os, signal, sys
      sys.path.insert(0, {str(ROOT)!r})
      from examples.flax_lm import train
      kill_at = {kill_at_step!r}
      build = train.build
      def killing_build(cfg, mesh=None):
        built = build(cfg, mesh)
        step = built.train_step
        calls = [0]
        def step_then_maybe_die(*args):
          if kill_at is not None and calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
          calls[0] += 1
          return step(*args)
        return built._replace(train_step=step_then_maybe_die)
      train.build = killing_build
      train.main({list(overrides) + (["--resume"] if resume else [])!r})
  """)
  return subprocess.run(
    [sys.executable, "-c", script],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=300,
  )


def _curve(out_dir):
  keep = ("step", "train_loss", "val_loss", "grad_norm", "lr")
  return [
    {
      k: v
      for k, v in json.loads(line).items()
      if k in keep or k.startswith("update_rms")
    }
    for line in (out_dir / "metrics.jsonl").read_text().splitlines()
  ]


@pytest.mark.integration
def test_a_killed_and_resumed_run_equals_an_uninterrupted_one(tmp_path):
  common = SMALL + ["optim.optimizer=muon", "train.checkpoint_every=4"]
  whole = _run_in_subprocess(common + [f"train.out_dir={tmp_path / 'whole'}"])
  assert whole.returncode == 0, whole.stderr
  killed_dir = tmp_path / "killed"
  killed = _run_in_subprocess(
    common + [f"train.out_dir={killed_dir}"], kill_at_step=10
  )
  assert killed.returncode == -9  # SIGKILL after checkpoints 4 and 8
  assert not (killed_dir / "final.json").exists()
  assert [
    json.loads(l)["step"]
    for l in (killed_dir / "metrics.jsonl").read_text().splitlines()
  ][-1] == 10
  resumed = _run_in_subprocess(
    common + [f"train.out_dir={killed_dir}"], resume=True
  )
  assert resumed.returncode == 0, resumed.stderr
  final_whole = json.loads((tmp_path / "whole" / "final.json").read_text())
  final_resumed = json.loads((killed_dir / "final.json").read_text())
  assert final_resumed["params_sha256"] == final_whole["params_sha256"]
  assert final_resumed["final_val_loss"] == final_whole["final_val_loss"]
  assert _curve(killed_dir) == _curve(tmp_path / "whole")
  assert set(final_whole) == {
    "optimizer",
    "steps",
    "final_val_loss",
    "params_sha256",
  }


def _tear(root, newer):
  for file in (root / "ckpt" / "2").rglob("*"):
    if file.is_file() and "meta" not in file.parts:
      file.write_bytes(b"\0" * 7)  # a torn write: orbax cannot read it


def _flip_one_value(root, newer):
  # step 2's arrays replaced by a valid orbax save with one value flipped:
  # orbax reads it; only the SHA-256 recorded in its meta can tell
  flipped = {"w": newer["w"].copy(), "n": newer["n"]}
  flipped["w"][2] = -flipped["w"][2]
  checkpoint_lib.Checkpointer(root / "other").save(2, flipped, {})
  shutil.rmtree(root / "ckpt" / "2" / "arrays")
  shutil.copytree(
    root / "other" / "2" / "arrays", root / "ckpt" / "2" / "arrays"
  )


@pytest.mark.parametrize(
  "damage, reason", [(_tear, "checkpoint 2"), (_flip_one_value, "SHA-256")]
)
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous(
  tmp_path, caplog, damage, reason
):
  saver = checkpoint_lib.Checkpointer(tmp_path / "ckpt", keep=3)
  state = {"w": np.arange(6, dtype=np.float32), "n": np.int32(3)}
  newer = {"w": state["w"] + 1, "n": np.int32(4)}
  saver.save(1, state, {"data_position": 1})
  saver.save(2, newer, {"data_position": 2})
  damage(tmp_path, newer)
  caplog.set_level(logging.WARNING, logger="flax_lm")
  restored, meta = checkpoint_lib.Checkpointer(
    tmp_path / "ckpt"
  ).restore_latest(state)
  assert meta["step"] == 1
  np.testing.assert_array_equal(restored["w"], state["w"])
  assert any(reason in r.getMessage() for r in caplog.records)


def _cli_error(capsys, argv):
  with pytest.raises(SystemExit) as exited:
    train_lib.main(argv)
  err = capsys.readouterr().err
  assert exited.value.code == 2
  assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
  return err


@pytest.mark.integration
def test_cli_errors_are_one_line_and_a_nonzero_exit(tmp_path, capsys):
  out = [f"train.out_dir={tmp_path / 'run'}"] + SMALL
  assert "does not exist" in _cli_error(
    capsys, out + ["--data", "/nonexistent"]
  )
  assert "unknown field" in _cli_error(capsys, out + ["model.n_layers=3"])
  (tmp_path / "run").mkdir(exist_ok=True)
  (tmp_path / "run" / "checkpoints").write_text("not a folder")
  assert "checkpoints" in _cli_error(capsys, out)
  (tmp_path / "run" / "checkpoints").unlink()
  (tmp_path / "run" / "checkpoints" / "4").mkdir(parents=True)  # unreadable
  assert "no checkpoint" in _cli_error(capsys, out + ["--resume"])


def test_data_errors_are_clear(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    ByteCorpus(tmp_path / "missing")
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="holds no"):
    ByteCorpus(tmp_path / "empty")
  (tmp_path / "tiny.txt").write_text("ab")
  with pytest.raises(ValueError, match="too little text"):
    ByteCorpus(tmp_path / "tiny.txt")


def test_batches_are_a_function_of_the_step(tmp_path):
  text = tmp_path / "book.txt"
  text.write_text("".join(chr(97 + i % 26) for i in range(5000)))
  corpus = ByteCorpus(text)
  a = corpus.batch("train", 7, 3, 16)
  b = corpus.batch("train", 7, 3, 16)
  c = corpus.batch("train", 8, 3, 16)
  np.testing.assert_array_equal(a[0], b[0])
  assert not np.array_equal(a[0], c[0])
  np.testing.assert_array_equal(a[0][:, 1:], a[1][:, :-1])  # shifted by one


def test_bad_run_overrides_raise():
  with pytest.raises(ValueError, match="preset"):
    config_lib.run_config(["preset=huge"])
  with pytest.raises(ValueError, match="warmup_steps"):
    config_lib.run_config(["train.steps=5"])
  with pytest.raises(ValueError, match="unknown field"):
    config_lib.run_config(["model.n_layers=3"])
  with pytest.raises(ValueError, match="n_head"):
    config_lib.run_config(["model.n_head=5"])


def test_the_first_command_compares_three_contestants_and_all_eight(
  monkeypatch, capsys
):
  # the README's first command (compare's defaults) runs AdamW, optax_muon
  # and optax.contrib.muon; --all adds NorMuon, AdaMuon, Dion2, NorDion2
  calls = []

  def fake_compare(overrides, **kwargs):
    calls.append(kwargs)
    base = config_lib.run_config(overrides)
    chosen = kwargs["sweeps"] or {
      name: compare_lib.SWEEPS[base.preset][name]
      for name in kwargs["contestants"] or compare_lib.SWEEPS[base.preset]
    }
    return {"preset": base.preset, "best": {}, "ran": sorted(chosen)}

  monkeypatch.setattr(compare_lib, "compare", fake_compare)
  assert compare_lib.main([])["ran"] == ["adam", "muon", "optax"]
  assert compare_lib.main(["--all"])["ran"] == [
    "adam",
    "adamuon",
    "dion",
    "dion2",
    "muon",
    "nordion2",
    "normuon",
    "optax",
  ]
  ran = compare_lib.main(["preset=small", "--lrs", "normuon=4e-3"])["ran"]
  assert ran == ["normuon"]
  with pytest.raises(SystemExit):
    compare_lib.main(["--all", "--lrs", "muon=1e-2"])
  assert "--all and --lrs" in capsys.readouterr().err


def test_compare_caches_compiled_programs_for_the_call():
  # without a configured cache, one in a temporary folder for the call (the
  # seeds of one lr share their programs), removed afterwards
  settings = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
  )
  original = {name: getattr(jax.config, name) for name in settings}
  try:
    jax.config.update("jax_compilation_cache_dir", None)
    with runs_lib.compilation_cache():
      folder = jax.config.jax_compilation_cache_dir
      assert "compare-jax-cache-" in folder
      assert pathlib.Path(folder).is_dir()
      assert jax.config.jax_persistent_cache_min_compile_time_secs < 1
    assert jax.config.jax_compilation_cache_dir is None
    assert not pathlib.Path(folder).exists()
    assert (
      jax.config.jax_persistent_cache_min_compile_time_secs
      == (original["jax_persistent_cache_min_compile_time_secs"])
    )
    # a user's own cache is kept
    jax.config.update("jax_compilation_cache_dir", "/theirs")
    with runs_lib.compilation_cache():
      assert jax.config.jax_compilation_cache_dir == "/theirs"
  finally:
    for name, value in original.items():
      jax.config.update(name, value)


@pytest.mark.integration
def test_compare_runs_three_contestants(tmp_path, monkeypatch, capsys):
  # one lr each, not extended (the bracketing is the next test's)
  monkeypatch.setattr(compare_lib, "MAX_EXTENSIONS", 0)
  summary = compare_lib.compare(
    SMALL + ["train.steps=8", "train.eval_every=4"],
    sweeps={"adam": (3e-3,), "muon": (1e-2,), "optax": (2e-2,)},
    out=tmp_path,
    seeds=(0,),
  )
  root = tmp_path / "tiny"
  for name in (
    "adam.jsonl",
    "muon.jsonl",
    "optax.jsonl",
    "summary.json",
    "val_loss.png",
  ):
    assert (root / name).stat().st_size > 0, name
  for name, lr in (("adam", 3e-3), ("muon", 1e-2), ("optax", 2e-2)):
    assert summary["best"][name]["lr"] == lr
    assert not summary["best"][name]["bracketed"]  # one lr is at both edges
    assert summary["best"][name]["final_val_loss"] < np.log(256)
  info = json.loads(
    (root / "runs" / "tiny-optax-lr0.02-seed0" / "run.json").read_text()
  )
  ours = json.loads(
    (root / "runs" / "tiny-muon-lr0.01-seed0" / "run.json").read_text()
  )
  # optax orthogonalizes the embeddings and the head too
  assert info["ns_flops_per_step"] > ours["ns_flops_per_step"] > 0
  assert set(summary["vs_adam"]) == {"muon", "optax"}
  # one overall bar (done / total) with each finished run printed above it
  shown = capsys.readouterr().out
  assert "runs 3/3" in shown and "runs 0/3" in shown
  for run in ("adam-lr0.003", "muon-lr0.01", "optax-lr0.02"):
    assert f"tiny-{run}-seed0: val loss " in shown, run
  # a second call reuses every finished run: nothing is trained again
  train = compare_lib.train_lib.train
  monkeypatch.setattr(compare_lib.train_lib, "train", None)
  again = compare_lib.compare(
    SMALL + ["train.steps=8", "train.eval_every=4"],
    sweeps={"adam": (3e-3,), "muon": (1e-2,), "optax": (2e-2,)},
    out=tmp_path,
    seeds=(0,),
  )
  assert again["best"] == summary["best"]
  assert capsys.readouterr().out.count("(reused)") == 3
  # sweeping one more contestant keeps the three recorded ones, and its
  # ratios are against the recorded AdamW
  monkeypatch.setattr(compare_lib.train_lib, "train", train)
  more = compare_lib.compare(
    SMALL + ["train.steps=8", "train.eval_every=4"],
    sweeps={"normuon": (1e-2,)},
    out=tmp_path,
    seeds=(0,),
  )
  assert more["best"] == summary["best"] | {"normuon": more["best"]["normuon"]}
  assert more["sweep"][:3] == summary["sweep"]
  assert more["vs_adam"]["muon"] == summary["vs_adam"]["muon"]
  normuon = more["vs_adam"]["normuon"]
  assert (
    normuon["adam_final_val_loss"] == summary["best"]["adam"]["final_val_loss"]
  )
  curve = [
    json.loads(l)
    for l in (root / "normuon.jsonl").read_text().splitlines()
    if "val_loss" in l
  ]
  reached = next(
    (
      r["step"]
      for r in curve
      if r["val_loss"] <= normuon["adam_final_val_loss"]
    ),
    None,
  )
  assert normuon["reaches_it"] == (reached is not None)
  if reached is not None:
    assert normuon["step_ratio"] == reached / 8


def test_sweep_brackets_the_best_lr_and_averages_seeds(tmp_path, monkeypatch):
  calls = []

  def fake_run(overrides, contestant, lr, seed, root, reuse, runs_bar=None):
    calls.append((lr, seed))  # a bowl in log lr with its bottom at 8e-3
    loss = (np.log(lr / 8e-3)) ** 2 + 0.01 * seed
    return {"final_val_loss": loss}, tmp_path / f"{lr}-{seed}"

  monkeypatch.setattr(compare_lib, "run_one", fake_run)
  results, bracketed = compare_lib.sweep(
    [], "muon", (1e-3, 2e-3), (0, 1), tmp_path, True
  )
  assert bracketed and sorted(results) == [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2]
  assert min(results, key=lambda lr: results[lr]["final_val_loss"]) == 8e-3
  assert results[8e-3]["seeds"] == [0.0, 0.01]
  assert results[8e-3]["final_val_loss"] == pytest.approx(0.005)
  assert len(calls) == 2 * len(results)  # each lr once per seed
  monkeypatch.setattr(compare_lib, "MAX_EXTENSIONS", 1)
  results, bracketed = compare_lib.sweep(
    [], "muon", (1e-4,), (0,), tmp_path, True
  )
  assert not bracketed and sorted(results) == [1e-4, 2e-4]


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["duplicated", "blockwise"])
def test_muon_trains_on_a_data_model_mesh(tmp_path, mode):
  mesh = distributed.parse_mesh("data=2,model=4")
  cfg = config_lib.run_config(
    SMALL
    + [
      "optim.optimizer=muon",
      f"optim.muon_tp_mode={mode}",
      "model.n_head=4",
      "train.steps=6",
      f"train.out_dir={tmp_path}",
      "train.eval_every=6",
    ]
  )
  final = train_lib.train(cfg, mesh=mesh)
  curve = [
    json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()
  ]
  assert curve[-1]["train_loss"] < curve[0]["train_loss"]
  if mode == "duplicated":  # the full-matrix update: same run as unsharded
    plain = train_lib.train(
      dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, out_dir=str(tmp_path / "plain")),
        optim=dataclasses.replace(cfg.optim, muon_tp_mode=None),
      )
    )
    assert final["final_val_loss"] == pytest.approx(
      plain["final_val_loss"], abs=2e-3
    )
  with pytest.raises(ValueError, match="XLA_FLAGS"):
    distributed.parse_mesh("data=4,model=4")


@pytest.mark.integration
def test_blockwise_split_qkv_needs_whole_heads_per_shard(tmp_path):
  cfg = config_lib.run_config(
    SMALL
    + [  # 2 heads over 4 model shards
      "optim.optimizer=muon",
      "optim.muon_tp_mode=blockwise",
      f"train.out_dir={tmp_path}",
    ]
  )
  with pytest.raises(ValueError, match="split_qkv cannot split"):
    train_lib.train(cfg, mesh=distributed.parse_mesh("data=2,model=4"))


@pytest.mark.integration
@pytest.mark.parametrize(
  "model", [[], ["model.attention=mla", "model.mlp=swiglu"]], ids=["gqa", "mla"]
)
def test_qk_clip_demo_holds_the_logits_at_tau(tmp_path, model):
  tau = 1.0  # below what this small model reaches: the clip must act
  summary = qk_clip_demo.demo(
    SMALL + model + [f"optim.qk_clip_threshold={tau}"], out=tmp_path
  )
  for name in ("summary.json", "qk_clip.png", "plain.jsonl", "clip.jsonl"):
    assert (tmp_path / name).stat().st_size > 0, name
  plain, clipped = summary["without QK-clip"], summary["with QK-clip"]
  assert plain["max_logit_last_quarter"] > 2 * tau
  # held near τ: a step exceeds it by at most what one update adds
  assert clipped["max_logit_last_quarter"] < 1.5 * tau


@pytest.mark.integration
@pytest.mark.parametrize(
  "fields",
  [
    {},
    {"scan_layers": True, "fused_qkv": False, "n_kv_head": 2},
    {"attention": "mla", "mlp": "swiglu"},
    {"attention": "mla", "scan_layers": True},
  ],
)
def test_cached_decoding_equals_the_full_forward(fields):
  # a prefill of 12 tokens, then one token at a time over the cache, gives
  # the logits the causal forward gives at every position
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from examples.flax_lm.model import GPT
  from examples.flax_lm.model import GPTConfig

  cfg = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=24, **fields)
  model = GPT(cfg, nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (3, 16), 0, 256)
  logits, cache = model.decode(tokens[:, :12], model.init_cache(3, 24), 0)
  pieces = [logits]
  for position in range(12, 16):
    logits, cache = model.decode(
      tokens[:, position : position + 1], cache, position
    )
    pieces.append(logits)
  np.testing.assert_allclose(
    jnp.concatenate(pieces, axis=1), model(tokens), atol=2e-5
  )


def test_checkpointer_keeps_the_best_besides_the_latest(tmp_path):
  # with best_metric, orbax keeps the newest and the highest-scoring step
  saver = checkpoint_lib.Checkpointer(
    tmp_path / "ckpt", keep=1, best_metric="accuracy"
  )
  for step, accuracy in [(10, 0.3), (20, 0.5), (30, 0.4), (40, 0.2)]:
    saver.save(
      step,
      {"w": np.full(3, step, np.float32)},
      {},
      metrics={"accuracy": accuracy},
    )
  assert saver.best_step() == 20
  assert sorted(saver._manager.all_steps()) == [20, 40]
  restored, meta = saver.restore(
    saver.best_step(), {"w": np.zeros(3, np.float32)}
  )
  assert meta["step"] == 20
  np.testing.assert_array_equal(restored["w"], np.full(3, 20, np.float32))


@pytest.mark.integration
@pytest.mark.parametrize(
  "contestant", ["normuon", pytest.param("adamuon", marks=pytest.mark.slow)]
)
def test_the_adaptive_contestants_run_with_the_example_muon_settings(
  tmp_path, contestant, monkeypatch
):
  layouts = []
  infer_layout = om.infer_layout

  def counted_infer_layout(*args, **kwargs):
    layouts.append(infer_layout(*args, **kwargs))
    return layouts[-1]

  monkeypatch.setattr(om, "infer_layout", counted_infer_layout)
  final, run_dir = compare_lib.run_one(
    SMALL + ["train.steps=4", "train.eval_every=4"],
    contestant,
    1e-3,
    0,
    tmp_path,
    False,
  )
  settings = json.loads((run_dir / "config.json").read_text())["optim"]
  assert settings["optimizer"] == "adaptive_muon"
  assert settings["adaptive_muon_moment2_method"] == contestant
  assert settings["muon_match_adamw_update_rms"]  # as the muon contestant
  info = json.loads((run_dir / "run.json").read_text())
  assert info["ns_flops_per_step"] > 0  # its Newton–Schulz is counted
  assert np.isfinite(final["final_val_loss"])
  # the model is traced once: the describe log reuses the optimizer's layout
  assert len(layouts) == 1


@pytest.mark.integration
def test_the_summary_records_the_python_and_the_text(tmp_path):
  summary = compare_lib.compare(
    SMALL + ["train.steps=4", "train.eval_every=4"],
    sweeps={"adam": (3e-3,)},
    out=tmp_path,
    seeds=(0,),
    max_extensions=0,
  )
  corpus = ByteCorpus(None, max_bytes=200000).describe()
  assert summary["python"] == platform.python_version()
  assert summary["corpus"] == corpus
  assert corpus["source"].startswith("the standard library of Python")
  assert (
    ByteCorpus(None, max_bytes=100000).describe()["sha256"]
    != (corpus["sha256"])
  )


def test_the_corpus_note_says_when_the_recorded_figures_trained_elsewhere(
  tmp_path,
):
  ours = ByteCorpus(None, max_bytes=200000).describe()
  recorded = tmp_path / "tiny_five"
  recorded.mkdir()
  other = dict(ours, sha256="0" * 64, source="the standard library of 3.11")
  (recorded / "summary.json").write_text(json.dumps({"corpus": other}))
  summary = {"preset": "tiny", "corpus": ours}
  note = compare_lib.corpus_note(summary, tmp_path)
  assert "the recorded figures" in note and "train.data=" in note
  assert "the standard library of 3.11" in note
  (recorded / "summary.json").write_text(json.dumps({"corpus": ours}))
  assert compare_lib.corpus_note(summary, tmp_path).startswith("Same text")


@pytest.mark.integration
def test_the_recorded_tiny_figure_on_the_same_text(tmp_path):
  # docs/examples.md's tiny table holds for the text it was trained on (the
  # standard library of the Python it names); another Python's differs
  recorded = json.loads(
    (ROOT / "results" / "tiny_five" / "summary.json").read_text()
  )
  cfg = config_lib.run_config(
    [
      "optim.optimizer=adam",
      "optim.lr=0.01",
      "train.progress=false",
      f"train.out_dir={tmp_path}",
    ]
  )
  corpus = ByteCorpus(cfg.train.data, max_bytes=cfg.train.max_bytes)
  if corpus.describe()["sha256"] != recorded["corpus"]["sha256"]:
    pytest.skip(
      f"the recorded figures trained on {recorded['corpus']['source']}; "
      f"this is {corpus.source}"
    )
  final = train_lib.train(cfg)
  # AdamW at its best lr, seed 0
  assert final["final_val_loss"] == pytest.approx(
    recorded["best"]["adam"]["seeds"][0], abs=5e-4
  )


@pytest.mark.integration
def test_an_offloaded_run_resumes_exactly(tmp_path):
  # optim.optimizer_offload=true: the state in pinned host memory, saved and
  # restored there; resuming from step 8 ends where the whole run does
  common = SMALL + [
    "optim.optimizer=muon",
    "optim.optimizer_offload=true",
    "train.checkpoint_every=4",
  ]
  whole = train_lib.train(
    config_lib.run_config(common + [f"train.out_dir={tmp_path / 'whole'}"])
  )
  resumed_dir = tmp_path / "resumed"
  shutil.copytree(tmp_path / "whole", resumed_dir)
  shutil.rmtree(resumed_dir / "checkpoints" / "12")
  (resumed_dir / "final.json").unlink()
  resumed = train_lib.train(
    config_lib.run_config(common + [f"train.out_dir={resumed_dir}"]),
    resume=True,
  )
  assert resumed["params_sha256"] == whole["params_sha256"]
  assert _curve(resumed_dir) == _curve(tmp_path / "whole")
  built = train_lib.build(config_lib.run_config(common))
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(built.opt_state)}
  assert kinds == {"pinned_host"}


@pytest.mark.integration
def test_a_mesh_run_compiles_its_step_once():
  # the step returns params and state with the shardings it took them in, so
  # the second step reuses the first's program (it used to compile again)
  cfg = config_lib.run_config(
    SMALL + ["optim.optimizer=muon", "model.n_head=4"]
  )
  mesh = distributed.parse_mesh("data=2,model=4")
  built = train_lib.build(cfg, mesh)
  corpus = ByteCorpus(cfg.train.data, max_bytes=cfg.train.max_bytes)
  place = distributed.batch_placer(mesh)
  params, opt_state = built.params, built.opt_state
  for step in range(3):
    batch = corpus.batch("train", step, 8, cfg.model.block_size, 0)
    params, opt_state, _ = built.train_step(params, opt_state, *place(batch))
  assert built.train_step._cache_size() == 1


def test_orthogonalization_flops_count_what_each_optimizer_orthogonalizes():
  from examples.flax_lm.metrics import orthogonalization_flops

  # one 64 (fan_in) × 128 (fan_out) matrix, 3 stacked, and a bias left out
  params = {"w": np.zeros((3, 64, 128)), "b": np.zeros(128)}
  labels = {"w": "muon", "b": "adam"}
  count = lambda **fields: orthogonalization_flops(
    params, labels, om.MuonConfig(**fields), steps=5
  )
  ns = lambda m, n: 3 * 5 * (4 * m * m * n + 2 * m**3)  # m ≤ n
  assert count(optimizer="muon") == ns(64, 128)
  # Dion2: 16 of the 64 fan-in rows; NorDion2: 32 of the 128 output neurons
  assert count(optimizer="dion2") == ns(16, 128)
  assert count(optimizer="nordion2") == ns(32, 64)
  assert count(optimizer="dion2", dion2_fraction=1.0) == ns(64, 128)
  # Dion at rank 16 of 64: B·Q and Bᵀ·P on the tall 128 × 64, and the QR
  r = 16
  assert count(optimizer="dion", dion_rank_fraction=0.25) == pytest.approx(
    3 * (4 * 128 * 64 * r + 4 * 128 * r * r - 4 * r**3 / 3)
  )
