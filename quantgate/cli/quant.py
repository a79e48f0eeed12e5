"""`quantgate schemes` (ranked scheme table) and `quantgate quantize` (llmcompressor in a child process).

For a CPU profile (and `--hardware auto`, which detects one) `schemes` asks the kernel probe what this machine's
serving build runs (quantgate.serving.cpu_kernels): a scheme whose kernel is missing is ranked as not running here, with
the probe's finding, and `--scheme S` exits 2 when S cannot run here.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.quantize.calibration import CalibrationSpec
from quantgate.quantize.preflight import read_layout
from quantgate.quantize.recipes import RecipeOverrides
from quantgate.quantize.run import MANIFEST, QuantizeRequest, quantize as run
from quantgate.quantize.schemes import load_schemes, rank_schemes
from quantgate.spec.familycheck import matrix_reasons
from quantgate.serving.cpu_kernels import kernel_reasons, resolve_hardware
from quantgate.target.hardware import AUTO, get_profile, load_catalogue

GIB = 1024**3


def _here(hardware: str, con: Console) -> tuple[str, dict[str, str]]:
    """The profile id (`auto` detected) and, for a CPU profile, scheme -> why this machine's serving build cannot run
    it. Without a serving environment an explicit profile falls back to its support table, said in a note."""
    hw_id, note = resolve_hardware(hardware)
    if note:
        con.print(f"[dim]{note}[/]")
    try:
        return hw_id, kernel_reasons(hw_id, [s.id for s in load_schemes().schemes])
    except QuantgateError as exc:
        if hardware.strip().lower() == AUTO:
            raise
        con.print(f"[dim]kernel probe not run ({exc.message}): the support table alone says what runs[/]")
        return hw_id, {}


def _refuse(wanted: list[str], ranking, missing: dict[str, str], hw_id: str) -> None:
    """Exit 2 naming the reason when a scheme asked for with --scheme does not run on this hardware here."""
    rows = {r.scheme: r for r in ranking.rows}
    for scheme in wanted:
        row = rows.get(scheme.strip().lower())
        if row is None:
            raise ConfigError(f"unknown scheme '{scheme}'", where="--scheme", fix=f"use one of: {', '.join(rows)}")
        if not row.supported:
            raise ConfigError(f"{row.scheme} cannot run on {hw_id} here: {missing.get(row.scheme, row.reason)}",
                              where="--scheme", fix="pick a scheme marked 'yes' above (or other hardware)")


def schemes(
    hardware: str = typer.Option(..., "--hardware", "-H", help="hardware id, e.g. h100, a100, l40s, b200, x86-cpu, "
                                 "or auto (this machine's CPU profile, from the kernel probe)"),
    workload: str = typer.Option("throughput", "--workload", "-w", help="latency | throughput | fit"),
    model: Path = typer.Option(..., "--model", help="Hugging Face checkpoint folder (config.json + safetensors)"),
    scheme: list[str] = typer.Option([], "--scheme", help="exit 2 unless this scheme runs here (repeatable)"),
) -> None:
    """Rank quantization schemes for a model on a hardware target, with a reason per row."""
    con = Console()
    hw_id, missing = _here(hardware, con)
    profile = get_profile(hw_id)
    layout = read_layout(model)
    ids = [s.id for s in load_schemes().schemes if s.id not in missing]
    missing = matrix_reasons(Path(model) / "config.json", hw_id, ids) | missing  # the support matrix's failures
    size = layout.size(layout.default_targets())
    ranking = rank_schemes(profile, workload, size, load_schemes(), missing)
    con.print(f"[bold]{layout.model_type}[/] {model}: {size.quantizable_params + size.other_params:,} parameters, "
              f"{size.bytes_16bit / GIB:.2f} GiB at 16 bits ({size.quantizable_params:,} in quantizable Linear layers)")
    con.print(f"[bold]{profile.name}[/] ({profile.id}): {profile.devices_per_node} x {profile.memory_gib:g} GiB, "
              f"{profile.interconnect}; weight budget {ranking.budget_per_device / GIB:.1f} GiB per device; workload {workload}")
    table = Table(show_lines=False)
    for col in ("#", "scheme", "runs here", "weights", "devices", "accuracy risk", "reason"):
        table.add_column(col, overflow="fold")
    for row in ranking.rows:
        ok = "[green]yes[/]" if row.supported else "[red]no[/]"
        table.add_row(str(row.rank), row.scheme, ok, f"{row.weight_bytes / GIB:.2f} GiB", str(row.devices_needed), row.accuracy_risk, row.reason)
    con.print(table)
    con.print(("[bold green]recommended:[/] " if ranking.recommended else "[bold red]no fit:[/] ") + ranking.explanation)
    if profile.notes:
        con.print(f"[dim]{profile.id}: {profile.notes}[/]")
    con.print(f"[dim]support data: vLLM {load_catalogue().vllm_version} (quant_recipes/hardware.yaml)[/]")
    _refuse(scheme, ranking, missing, hw_id)


def quantize(
    model: Path = typer.Option(..., "--model", help="16-bit Hugging Face checkpoint folder"),
    scheme: str = typer.Option(..., "--scheme", help="fp8-dynamic | int8-w8a8 | w4a16-gptq | w4a16-awq | nvfp4"),
    out: Path = typer.Option(..., "--out", help="output folder for the compressed-tensors checkpoint"),
    hardware: str | None = typer.Option(None, "--hardware", "-H", help="refuse schemes this hardware cannot run"),
    recipe: Path | None = typer.Option(None, "--recipe", help="use this llmcompressor recipe instead of the scheme's"),
    group_size: int | None = typer.Option(None, "--group-size", help="weight group size (group-wise int schemes)"),
    ignore: list[str] = typer.Option([], "--ignore", help="extra module name or `re:` pattern to keep at 16 bits (repeatable)"),
    smoothing_strength: float | None = typer.Option(None, "--smoothing-strength", help="SmoothQuant alpha (int8-w8a8)"),
    calibration: Path | None = typer.Option(None, "--calibration", help="JSONL of {text} or {messages} records"),
    calibration_dataset: str | None = typer.Option(None, "--calibration-dataset", help="`datasets` name or local file"),
    split: str = typer.Option("train", "--split", help="split of --calibration-dataset"),
    samples: int | None = typer.Option(None, "--samples", help="calibration samples (default: the scheme's)"),
    seq_len: int | None = typer.Option(None, "--seq-len", help="tokens per calibration sample (default: the scheme's)"),
    seed: int = typer.Option(0, "--seed", help="seed for sampling calibration records"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing output made from other inputs"),
    timeout: float | None = typer.Option(None, "--timeout", help="stop the child after this many seconds"),
) -> None:
    """Quantize with llmcompressor (child process) into a compressed-tensors checkpoint plus manifest."""
    from pydantic import ValidationError


    try:
        req = QuantizeRequest(
            model=model, scheme=scheme, out=out, hardware=hardware, recipe=recipe, overwrite=overwrite,
            overrides=RecipeOverrides(group_size=group_size, ignore=ignore, smoothing_strength=smoothing_strength),
            calibration=CalibrationSpec(path=calibration, dataset=calibration_dataset, split=split, samples=samples,
                                        max_seq_length=seq_len, seed=seed))
    except ValidationError as exc:
        raise ConfigError("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()),
                          where="command line", fix="see `quantgate quantize --help`") from None
    con = Console(stderr=True)
    result = run(req, log=lambda s: con.print(f"[dim]{s}[/]"), timeout_s=timeout)
    m = result.manifest
    t = m.timings_s or {}
    print(f"{'reused' if result.reused else 'wrote'} {result.out}")
    print(f"  scheme {m.scheme}  hardware {m.hardware or '-'}  wall {t.get('wall')} s (oneshot {t.get('oneshot_s')} s)")
    print(f"  size {(m.size_on_disk_bytes or 0) / 1e6:.1f} MB on disk, weights {(m.weights_bytes or 0) / 1e6:.1f} MB, "
          f"compression x{m.compression_ratio}  manifest {result.out / MANIFEST}")
