"""Every Python code block of the README and docs/ runs; the migration table
covers every argument of optax.contrib.muon and every MuonConfig field; the
`small` comparison table (docs/examples.md) is the recorded one."""

import functools
import inspect
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_muon as om
from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(path):
  return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


BLOCKS = [
  (path, number, block)
  for path in DOCS
  for number, block in enumerate(_blocks(path))
]


# one test per block, so that the slow ones run in parallel
@pytest.mark.integration
@pytest.mark.parametrize(
  "path, number, block", BLOCKS, ids=[f"{p.name}[{n}]" for p, n, _ in BLOCKS]
)
def test_code_block_runs(path, number, block):
  try:
    exec(compile(block, f"{path.name}[{number}]", "exec"), {})
  except Exception as error:  # pylint: disable=broad-except
    pytest.fail(f"{path.name} block {number} raised {error!r}:\n{block}")


@pytest.mark.integration
def test_the_sharding_block_runs_on_one_device():
  # the tests simulate 8 CPU devices; a reader's laptop has one
  (block,) = [
    b
    for b in _blocks(ROOT / "docs" / "guide.md")
    if "model_axis = min(jax.device_count()" in b
  ]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  result = subprocess.run(
    [
      sys.executable,
      "-c",
      block + ("\nassert jax.device_count() == 1\nprint('losses', auto)"),
    ],
    env=dict(env, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert "losses" in result.stdout


def test_migration_tables_cover_every_argument_and_field():
  guide = (ROOT / "docs" / "guide.md").read_text()
  for name in inspect.signature(optax.contrib.muon).parameters:
    assert f"`{name}`" in guide, name
  for name in om.MuonConfig.field_names():
    assert f"| `{name}` |" in guide, name


def test_readme_is_a_front_page_linking_every_page():
  readme = (ROOT / "README.md").read_text()
  assert len(readme.splitlines()) <= 200
  pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {
    "index.md",
    "changelog.md",
    "getting_started.md",
  }
  for target in (
    *(f"docs/{page}" for page in sorted(pages)),
    "CHANGELOG.md",
    "CONTRIBUTING.md",
    "notebooks/muon_quickstart.ipynb",
  ):
    assert target in readme, target


def test_no_page_links_to_a_public_home_the_project_does_not_have():
  # the project has no public repository: a link to one (a Colab badge, a
  # git clone) fails for the user who follows it
  pages = [ROOT / "README.md", ROOT / "notebooks" / "muon_quickstart.ipynb"]
  pages += sorted((ROOT / "docs").glob("*.md"))
  pages += sorted((ROOT / "examples").glob("*/README.md"))
  for page in pages:
    text = page.read_text()
    for dead in ("github.com/optax-muon", "colab.research.google.com/github"):
      assert dead not in text, (page.name, dead)


def test_readme_figures_are_the_recorded_ones():
  """Each figure of the README's "Measured" list, against the file that
  produced it (the comparison's and the QK-clip demos' summaries) or the
  page whose table it heads (performance.md's measured column)."""
  readme = (ROOT / "README.md").read_text()
  measured = readme.split("## Measured")[1].split("\n## ")[0]
  small = json.loads((ROOT / "results/small/summary.json").read_text())
  best = {
    name: f"{small['best'][name]['final_val_loss']:.3f}"
    for name in ("adam", "optax", "muon", "normuon", "adamuon")
  }
  assert (
    f"final validation loss {best['adam']} (AdamW), {best['optax']} "
    f"(`optax.contrib.muon`),\n  {best['muon']} (optax_muon), "
    f"**{best['normuon']}** (optax_muon's NorMuon), {best['adamuon']} "
    "(its AdaMuon)"
  ) in measured
  ratio = {small["vs_adam"][n]["step_ratio"] for n in small["vs_adam"]}
  assert len(small["vs_adam"]) == 4
  assert ratio == {0.5} and "in 50% of the\n  steps" in measured
  for folder, pair in (
    ("qk_clip", "reaches {} without the clip and at most\n  {} with it"),
    ("qk_clip_mla", "{} against {}"),
  ):
    demo = json.loads((ROOT / "results" / folder / "summary.json").read_text())
    assert demo["settings"]["qk_clip_threshold"] == 100.0
    figures = [
      f"{demo[run]['max_logit']:.1f}"
      for run in ("without QK-clip", "with QK-clip")
    ]
    assert pair.format(*figures) in measured, (folder, figures)
  performance = (ROOT / "docs" / "performance.md").read_text()
  for figure in (
    '**0.60 with `method="gram"`**',
    "**0.502**",
    "duplicated 0.089 · allgather 0.044",
  ):
    assert figure in performance, figure
  for quoted in ("0.60×", "0.502×", "0.089×", "0.044×"):
    assert quoted in measured, quoted


def test_the_muon_bp_paragraph_is_the_recorded_runs():
  """docs/performance.md's MuonBP figures on the small preset, against
  results/small_muon_bp/summary.json; MuonBP within 0.03 of Muon on the
  same mesh (issue 44)."""
  summary = json.loads(
    (ROOT / "results" / "small_muon_bp" / "summary.json").read_text()
  )
  page = " ".join((ROOT / "docs" / "performance.md").read_text().split())
  for name, label in (("muon_bp", "MuonBP"), ("muon", "Muon")):
    seeds = [
      r["final_val_loss"]
      for r in summary["runs"]
      if r["optimizer"] == name and r["mesh"] == "model=2"
    ]
    assert len(seeds) == 2
    figure = (
      f"**{label} {sum(seeds) / 2:.3f}** ({seeds[0]:.3f}, {seeds[1]:.3f})"
    )
    assert figure in page, figure
  means = summary["mean_on_mesh"]
  assert abs(means["muon_bp"] - means["muon"]) <= 0.03
  ratio = summary["step_over_muon"]["muon_bp"]
  assert f"Its step costs {ratio:.2f}× Muon's" in page


def test_the_overlap_limit_sentence_is_the_recorded_compile():
  """docs/performance.md's figures under XLA's collective overlap limit, on
  the H100-64 compile of Llama-3-70B (FSDP 8 x TP 8, allgather), against
  the runs that wrote them; at XLA's default limit (1) they are the FSDP
  table's own allgather row, compiled the same way."""
  path = ROOT / "results" / "at_scale" / "h100_64_70b_overlap_limit.jsonl"
  runs = [json.loads(line) for line in path.read_text().splitlines()]
  flag = "--xla_gpu_experimental_parallel_collective_overlap_limit="
  by_limit = {int(r["xla_flags"].removeprefix(flag)): r for r in runs}
  assert sorted(by_limit) == [1, 2, 4]
  exposed = {
    n: f"{r['schedule']['exposed_ms']:.1f}" for n, r in by_limit.items()
  }
  temp = {n: f"{r['temp_gib']:.2f}" for n, r in by_limit.items()}
  share = {n: f"{100 * r['step_share']:.2f}" for n, r in by_limit.items()}
  page = " ".join((ROOT / "docs" / "performance.md").read_text().split())
  sentence = (
    f"exposed {exposed[1]} → {exposed[2]} ms at N = 2 and {exposed[4]} ms at"
    f" N = 4, temp {temp[1]} → {temp[2]} and {temp[4]} GiB, share"
    f" {share[1]} → {share[2]} and {share[4]} %"
  )
  assert sentence in page, sentence
  table = ROOT / "results" / "at_scale" / "h100_64_70b_fsdp.jsonl"
  records = [json.loads(line) for line in table.read_text().splitlines()]
  (default,) = [r for r in records if r["mode"] == "allgather"]
  for key in ("temp_gib", "step_share", "hlo_tflop"):
    assert by_limit[1][key] == pytest.approx(default[key], rel=1e-9), key
  assert by_limit[1]["schedule"] == pytest.approx(default["schedule"])


def test_the_dion2_paragraph_is_the_recorded_runs():
  """docs/performance.md's Dion2 figures on the small preset, against
  results/small_dion2/summary.json: at fraction 1 Dion2 is Muon without
  Nesterov (within 0.01), and the gap grows as the fraction shrinks."""
  summary = json.loads(
    (ROOT / "results" / "small_dion2" / "summary.json").read_text()
  )
  page = " ".join((ROOT / "docs" / "performance.md").read_text().split())
  seed0 = {
    (r["optimizer"], r.get("fraction")): r["final_val_loss"]
    for r in summary["runs"]
    if r["seed"] == 0 and r["lr"] == 0.008
  }
  plain = seed0[("muon", None)]
  by_fraction = [seed0[("dion2", f)] for f in (1.0, 0.5, 0.25)]
  assert f"**Fraction 1: {by_fraction[0]:.3f}**" in page
  assert f"`optim.muon_nesterov=false` **{plain:.3f}**" in page
  assert (
    f"Fraction 0.5: {by_fraction[1]:.3f}; 0.25: {by_fraction[2]:.3f}" in page
  )
  assert abs(by_fraction[0] - plain) <= 0.01
  assert by_fraction == sorted(by_fraction)


def test_the_api_reference_lists_every_public_name():
  from optax_muon import compat

  api = (ROOT / "docs" / "api.md").read_text()
  documented = set(
    re.findall(r"^\.\. (?:auto\w+|py:\w+):: ([\w.]+)$", api, re.M)
  )
  public = {f"optax_muon.{name}" for name in om.__all__ if name != "compat"}
  public |= {f"optax_muon.compat.{name}" for name in compat.__all__}
  assert public <= documented, sorted(public - documented)


ROWS = {
  "AdamW": "adam",
  "`optax.contrib.muon`": "optax",
  "optax_muon": "muon",
  "NorMuon": "normuon",
  "AdaMuon": "adamuon",
}


@pytest.mark.parametrize(
  "heading, recorded_in, contestants",
  [
    ("### Five contestants on the `tiny` preset", "tiny_five", 5),
    ("### Five contestants on the `small` preset", "small", 5),
  ],
)
def test_the_comparison_tables_are_the_recorded_ones(
  heading, recorded_in, contestants
):
  """Each table of docs/examples.md quotes its compare.py summary.json to
  the digits shown: each sweep point, the best lr and the ratios."""
  summary = json.loads(
    (ROOT / "results" / recorded_in / "summary.json").read_text()
  )
  page = (ROOT / "docs" / "examples.md").read_text()
  section = page.split(heading)[1]
  section = section.split("\n#")[0]
  rows = dict(list(ROWS.items())[:contestants])
  seen = set()
  for line in section.splitlines():
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    name = next((rows[k] for k in rows if cells[0].startswith(k)), None)
    if name is None or len(cells) != 5:
      continue
    seen.add(name)
    quoted = {
      float(lr): loss
      for lr, loss in re.findall(r"([\d.e-]+): \**([\d.]+)", cells[1])
    }
    recorded = {
      row["lr"]: f"{row['final_val_loss']:.3f}"
      for row in summary["sweep"]
      if row["optimizer"] == name
    }
    assert quoted == recorded, (name, quoted, recorded)
    best = summary["best"][name]
    assert best["bracketed"], name
    assert float(cells[2]) == best["lr"], name
    assert cells[3].strip("*") == f"{best['final_val_loss']:.3f}", name
    if name != "adam":
      ratios = summary["vs_adam"][name]
      assert cells[4] == (
        f"{ratios['step_ratio']:.0%} ({ratios['flop_ratio']:.0%} of the FLOPs)"
      ), name
  assert seen == set(rows.values())


def test_the_readme_use_comment_is_what_infer_layout_reads():
  # the comment over the Use block's update says where each leaf goes; the layout the
  # block builds must say the same
  block = _blocks(ROOT / "README.md")[0]
  scope: dict = {}
  exec(compile(block, "README.md[0]", "exec"), scope)
  *_, comment, last_line = block.strip().splitlines()
  assert last_line == "optimizer.update(model, grads)"
  assert (
    comment.strip("# ") == "hidden kernel: Muon; head kernel, biases: AdamW"
  )
  labels, roles = scope["layout"].labels, scope["layout"].roles
  layers = scope["model"].layers
  first, last = (i for i, l in enumerate(layers) if hasattr(l, "kernel"))
  assert labels["layers"][first]["kernel"] == "muon"
  assert roles["layers"][last]["kernel"] == "head"
  assert labels["layers"][last]["kernel"] == "adam"
  for index in (first, last):
    assert labels["layers"][index]["bias"] == "adam"


@pytest.mark.parametrize(
  "option",
  [
    "mu_dtype=om.QuantizedMomentum(),",
    'state_memory_kind="pinned_host",',
  ],
)
def test_the_readme_use_block_takes_two_steps_with_each_state_option(option):
  # the block's own pattern (nnx.Optimizer) with the 8-bit or offloaded
  # state: the second update is where a pytree leaf of the state broke
  block = _blocks(ROOT / "README.md")[0]
  assert "    weight_decay=0.1,\n" in block
  block = block.replace(
    "    weight_decay=0.1,\n", f"    weight_decay=0.1,\n    {option}\n"
  )
  block += "\nfor _ in range(2):\n  optimizer.update(model, grads)\n"
  scope: dict = {}
  exec(compile(block, "README.md[0]", "exec"), scope)
  leaves = jax.tree.leaves(scope["model"])
  assert leaves and all(bool(jnp.all(jnp.isfinite(x))) for x in leaves)


def test_the_8_bit_table_is_the_recorded_one():
  summary = json.loads(
    (ROOT / "results" / "tiny_8bit" / "summary.json").read_text()
  )
  section = (ROOT / "docs" / "examples.md").read_text()
  section = section.split("### 8-bit momentum on the `tiny` preset")[1]
  section = section.split("\n#")[0]
  rows = {row["optimizer"]: row for row in summary["sweep"]}
  for name, label in (("muon", "| float32 |"), ("muon8bit", "| 8-bit")):
    line = next(l for l in section.splitlines() if l.startswith(label))
    cells = [c.strip() for c in line.strip("|").split("|")]
    seeds = [f"{x:.4f}" for x in rows[name]["seeds"]]
    assert cells[1:] == [*seeds, f"{rows[name]['final_val_loss']:.4f}"], name
  gap = rows["muon8bit"]["final_val_loss"] - rows["muon"]["final_val_loss"]
  spread = max(rows["muon"]["seeds"]) - min(rows["muon"]["seeds"])
  assert abs(gap) <= spread  # within float32's two-seed spread
  assert f"{abs(gap):.4f}" in section and f"{spread:.4f}" in section


def test_the_state_table_is_the_recorded_compile():
  """docs/scaling.md's table of state options, against the TPU compiles
  `benchmarks/at_scale.py` wrote (results/at_scale/)."""
  runs = [
    json.loads(line)
    for line in (ROOT / "results/at_scale/tpu_v5p_70b_state.jsonl")
    .read_text()
    .splitlines()
  ]
  row_of = {
    ("bf16", "param", False): "| bf16, momentum bf16 |",
    ("bf16", "8bit", False): "| bf16, 8-bit momentum |",
    ("bf16", "param", True): "| bf16, state in host memory |",
    ("fp32", "param", True): "| fp32 master params, state in host memory |",
  }
  page = (ROOT / "docs" / "scaling.md").read_text()
  for run in runs:
    key = (run["dtype"], run["momentum"], run["offload"])
    if run["mode"] != "duplicated" or key not in row_of:
      continue
    line = next(l for l in page.splitlines() if l.startswith(row_of[key]))
    cells = [c.strip("* ") for c in line.strip("|").split("|")]
    assert cells[1:5] == [
      f"{run['state_device_gib']:.1f}",
      f"{run['state_gib'] - run['state_device_gib']:.1f}",
      f"{run['temp_gib']:.1f}",
      f"{run['resident_gib']:.1f}",
    ], (key, cells)
    parts = ("80GB", "95GB", "141GB")
    fits = ["fits" if run["fits"][p] else "no" for p in parts]
    assert cells[5:8] == fits, (key, cells)
  refused = [r for r in runs if r["dtype"] == "fp32" and not r["offload"]]
  assert refused and not refused[0]["compiled"]
  assert refused[0]["resource_exhausted"]


def test_the_modeled_time_table_is_the_recorded_compile():
  """docs/scaling.md's modeled ms per mode, against the compiles
  `benchmarks/at_scale.py` wrote; auto never models more than the best
  exact mode."""
  modes = ("blockwise", "duplicated", "distributed", "allgather", "auto")
  page = (ROOT / "docs" / "scaling.md").read_text()
  for target, name in (("H100-8", "h100_8"), ("v5p-8", "tpu_v5p_8")):
    path = ROOT / "results" / "at_scale" / f"modeled_{name}.jsonl"
    runs = [json.loads(line) for line in path.read_text().splitlines()]
    for model in ("8b", "70b"):
      for precision in ("medium", "highest"):
        label = f"| {target}, {model}, `{precision}`: modeled ms |"
        lines = [l for l in page.splitlines() if l.startswith(label)]
        by_mode = {
          r["mode"]: r
          for r in runs
          if r["model"] == f"llama3-{model}" and r["precision"] == precision
        }
        assert bool(lines) == bool(by_mode), label
        if not lines:
          continue
        cells = [c.strip() for c in lines[0].strip("|").split("|")][1:]
        assert cells == [f"{by_mode[m]['modeled_ms']:,.0f}" for m in modes]
        exact = min(by_mode[m]["modeled_ms"] for m in modes[1:4])
        assert by_mode["auto"]["modeled_ms"] <= exact * (1 + 1e-9), label


def test_the_muon_bp_and_dion2_table_is_the_recorded_compile():
  """docs/scaling.md's MuonBP and Dion2 rows at 70B, against the compiles
  `benchmarks/at_scale.py --modes muon_bp` and `--modes
  allgather,dion2,dion2_global` wrote; MuonBP's step sends at most a quarter
  of allgather's bytes, Dion2's local scope at most 0.3×, both with temp
  under 8 GiB."""
  results = ROOT / "results" / "at_scale"
  family, dion2 = (
    {r["mode"]: r for r in map(json.loads, path.read_text().splitlines())}
    for path in (
      results / "tpu_v5p_8_70b_family.jsonl",
      results / "tpu_v5p_8_70b_dion2.jsonl",
    )
  )
  gather = family["allgather"]["collective_total_gib"]
  # the same allgather program compiled in both runs: the same bytes
  assert dion2.pop("allgather")["collective_total_gib"] == gather
  runs = {**family, **dion2}
  page = (ROOT / "docs" / "scaling.md").read_text()
  bp = runs["muon_bp"]
  local, whole = (
    runs[m]["collective_total_gib"] for m in ("dion2", "dion2_global")
  )
  row = (
    f"| collective GiB per step | {gather:.1f} | "
    f"{runs['blockwise']['collective_total_gib']:.1f} | "
    f"{bp['per_step_collective_gib']:.1f} "
    f"({bp['per_step_collective_gib'] / gather:.2f}× allgather) | "
    f"{local:.1f} ({local / gather:.2f}× allgather) | "
    f"{whole:.1f} ({whole / gather:.2f}× allgather) |"
  )
  assert row in page, row
  temps = " | ".join(
    f"{runs[m]['temp_gib']:.1f}"
    for m in ("allgather", "blockwise", "muon_bp", "dion2", "dion2_global")
  )
  assert f"| temp GiB | {temps} |" in page
  assert bp["per_step_collective_gib"] <= 0.25 * gather
  assert bp["temp_gib"] <= 8
  assert local <= 0.3 * gather and runs["dion2"]["temp_gib"] <= 8


def test_the_dion_paragraph_is_the_recorded_compile():
  """docs/scaling.md's Dion figures at 70B, against the compile
  `benchmarks/at_scale.py --modes dion,allgather` wrote."""
  path = ROOT / "results" / "at_scale" / "tpu_v5p_8_70b_dion.jsonl"
  runs = {r["mode"]: r for r in map(json.loads, path.read_text().splitlines())}
  page = " ".join((ROOT / "docs" / "scaling.md").read_text().split())
  dion, gather = runs["dion"], runs["allgather"]
  total = dion["collective_total_gib"]
  for figure in (
    f"sends **{total:.1f} GiB** a step, all of it all-reduce: "
    f"{total / gather['collective_total_gib']:.2f}× allgather's "
    f"{gather['collective_total_gib']:.1f} (temp {dion['temp_gib']:.1f} GiB)",
    f"its state is {dion['state_gib']:.1f} GiB per chip",
    f"allgather's {gather['state_gib']:.1f} GiB",
  ):
    assert figure in page, figure
  assert set(dion["collective_gib"]) == {"all-reduce"}
  assert dion["fits"]["80GB"] and dion["temp_gib"] <= 8
  householder = (
    ROOT / "results" / "at_scale" / ("tpu_v5p_8_70b_dion_householder.jsonl")
  )
  (qr,) = [
    r
    for r in map(json.loads, householder.read_text().splitlines())
    if r["mode"] == "dion"
  ]
  assert f"{qr['collective_total_gib']:,.0f} GiB a step" in page
  own = runs["dion_distributed"]
  assert set(own["collective_gib"]) == {"all-reduce"}
  assert (
    f"sends **{own['collective_total_gib']:.1f} GiB** a step, all of it "
    f"all-reduce, temp {own['temp_gib']:.1f} GiB"
  ) in page
  assert own["collective_total_gib"] <= 1.01 * total


def _scaling_row(page: str, label: str) -> list[str]:
  """The cells after the label of the one table row starting ``label``,
  bold marks stripped."""
  (line,) = [l for l in page.splitlines() if l.startswith(label)]
  return [c.strip("* ") for c in line.strip("|").split("|")][1:]


def test_the_fsdp_table_is_the_recorded_compile():
  """docs/scaling.md's FSDP x TP figures, against the 64-chip TPU compiles
  `benchmarks/at_scale.py` wrote; each exact mode's bytes are the Muon
  matrices' share of a data rank (127.5 GiB / 8) within 1.25x, plus its own
  tensor-parallel traffic, and its Newton-Schulz 1/8 of the model's."""
  path = ROOT / "results" / "at_scale" / "tpu_v5p_70b_fsdp.jsonl"
  runs = [json.loads(line) for line in path.read_text().splitlines()]
  modes = ("blockwise", "duplicated", "distributed", "allgather", "auto")
  page = (ROOT / "docs" / "scaling.md").read_text()

  row = functools.partial(_scaling_row, page)

  def by_mode(fsdp, distribute_over=None):
    return {
      r["mode"]: r
      for r in runs
      if r["mesh"] == "8x8"
      and r["fsdp"] == fsdp
      and r["distribute_over"] == distribute_over
    }

  total = lambda r: f"{sum(r['collective_gib'].values()):.2f}"
  matrix, layers = by_mode("matrix"), by_mode("layers")
  assert row("| FSDP on the matrix axis: **collective GiB now**") == [
    total(matrix[m]) for m in modes
  ]
  assert row("| FSDP on the layer axis: collective GiB") == [
    "0" if m == "blockwise" else total(layers[m]) for m in modes
  ]
  temps = row("| FSDP on the matrix axis: temp GiB, before → now")
  assert [t.split("→ ")[-1] for t in temps] == [
    f"{matrix[m]['temp_gib']:.2f}" for m in modes
  ]
  split = by_mode("matrix", "data")
  for mode in ("duplicated", "distributed", "allgather"):
    assert split[mode]["collective_gib"] == matrix[mode]["collective_gib"]
    share = 127.5 / 8
    own = {"duplicated": share, "distributed": 62.5 + 0.32, "allgather": 0}
    assert sum(matrix[mode]["collective_gib"].values()) <= (
      1.25 * share + own[mode]
    ), mode
    assert matrix[mode]["temp_gib"] <= 8
  whole = 13223.345  # the model's Newton-Schulz TFLOP, every matrix once
  assert matrix["duplicated"]["ns_tflop"] == pytest.approx(whole / 8, rel=1e-3)
  assert matrix["duplicated"]["cost_analysis_tflop"] == pytest.approx(
    layers["duplicated"]["cost_analysis_tflop"], rel=1e-3
  )


def test_the_61_layer_deepseek_rows_are_the_recorded_compiles():
  """docs/scaling.md's whole DeepSeek-V3 (61 layers, the step's half)
  against the v5p-64 compiles `benchmarks/at_scale.py --donate` wrote: with
  bf16 momentum each mode compiled and fits the 95.74 GiB chip; with 8-bit
  momentum the compiler refused, and the row says what it asked."""
  path = ROOT / "results" / "at_scale" / "tpu_v5p_64_deepseek_v3.jsonl"
  runs = [json.loads(line) for line in path.read_text().splitlines()]
  whole = [r for r in runs if r["model"] == "deepseek-v3"]
  assert whole and all(r["donate"] for r in whole)
  plain = {r["mode"]: r for r in whole if r["momentum"] == "param"}
  assert all(
    r["compiled"] and r["resident_gib"] <= 95.74 for r in plain.values()
  )
  page = (ROOT / "docs" / "scaling.md").read_text()

  row = functools.partial(_scaling_row, page)

  modes = ("duplicated", "distributed", "allgather", "auto")
  assert row("| 61 layers, the step's half (`--donate`)") == [
    f"{plain[m]['pgs_gib']:.1f} / {plain[m]['temp_gib']:.2f}" for m in modes
  ]
  (eight,) = [r for r in whole if r["momentum"] == "8bit"]
  assert not eight["compiled"] and eight["resource_exhausted"]
  asked = float(re.search(r"temporaries \((\d+\.\d+)G\)", eight["error"])[1])
  assert row("| 61 layers, 8-bit momentum, the step's half")[2] == (
    f"{eight['pgs_gib']:.1f} / refused ({asked:.1f} asked)"
  )


MAXTEXT_ROWS = {  # the table's row label: its results/maxtext file and mesh
  "Llama-2-7B, v5p-8, TP 4": ("llama2_7b_v5p_8", 1, 4),
  "Llama-2-7B, v5p-8, FSDP 4": ("llama2_7b_v5p_8", 4, 1),
  "Llama-3-70B, v5p-16 (8 chips), TP 8": ("llama3_70b_v5p_16", 1, 8),
  "Llama-3-70B, v5p-64 (32 chips), FSDP 4 × TP 8": ("llama3_70b_v5p_64", 4, 8),
  "DeepSeek-V3, 5 layers, v5p-16, TP 8": ("deepseek3_5layers_v5p_16", 1, 8),
}


def test_the_maxtext_compile_table_is_the_recorded_one():
  """docs/libraries.md's MaxText table quotes benchmarks/maxtext_compile.py's
  rows (results/maxtext/): temporaries / peak, GiB to 2 decimals."""
  page = (ROOT / "docs" / "libraries.md").read_text()
  section = page.split("**MaxText's own whole train step**")[1].split("```")[0]
  seen = set()
  for line in section.splitlines():
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    label = next((k for k in MAXTEXT_ROWS if cells[0].startswith(k)), None)
    if label is None:
      continue
    name, fsdp, tp = MAXTEXT_ROWS[label]
    path = ROOT / "results" / "maxtext" / f"{name}.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    by_mode = {r["mode"]: r for r in rows if (r["fsdp"], r["tp"]) == (fsdp, tp)}
    for cell, mode in zip(cells[1:], ("adamw", "maxtext_muon", "auto")):
      row = by_mode[mode]
      if not row["compiled"]:
        assert row["resource_exhausted"] and cell.startswith("refused")
        continue
      assert cell == f"{row['temp_gib']:.2f} / {row['peak_gib']:.2f}", (
        label,
        mode,
      )
    seen.add(label)
  assert seen == set(MAXTEXT_ROWS)
