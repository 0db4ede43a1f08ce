"""The dry run's plan on disk and on screen: ``_plan.json`` in the shard's output directory, the printed plan,
and the prediction set beside what a run did (the report's ``prediction`` section).

``_plan.json`` is written beside the parts but is none of batchgen's output files: ``data.overwrite`` and the
cleanup of a killed run leave it alone, and the output's rows and manifest are never touched by a dry run.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from batchgen.data.local_storage import LocalLocation
from batchgen.job.calibrate import compute_threads, load_average
from batchgen.job.eta import PlannedWork
from batchgen.runtime.atomic import atomic_write_text, remove_stale_temps

PLAN_NAME = "_plan.json"


def _location(outdir: Any) -> Any:
    """The object-store location of a remote output directory (None for a local one)."""
    return getattr(outdir, "loc", None)


def write_plan(outdir: Any, plan: dict[str, Any]) -> str:
    """Write ``_plan.json`` into the shard's output directory (atomically); returns where."""
    text = json.dumps(plan, indent=1, default=str) + "\n"
    loc = _location(outdir)
    if isinstance(loc, LocalLocation):  # a dry run killed while writing it left its temporary file
        remove_stale_temps(loc.path(PLAN_NAME))
    if loc is not None:
        loc.put(PLAN_NAME, text.encode())
        return str(loc.url_of(PLAN_NAME))
    outdir.path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(outdir.path / PLAN_NAME, text)
    return str(outdir.path / PLAN_NAME)


def read_plan(outdir: Any) -> dict[str, Any] | None:
    """The shard's ``_plan.json`` (None when there is none, or it cannot be read)."""
    try:
        loc = _location(outdir)
        if loc is not None:
            raw = loc.read_bytes(PLAN_NAME)
            return None if raw is None else json.loads(raw.decode())
        p = outdir.path / PLAN_NAME
        return json.loads(p.read_text()) if p.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None


def planned_work(outdir: Any, fingerprint: str | None = None) -> PlannedWork | None:
    """The work ``_plan.json`` predicts for the shard, for the live ETA (None without a plan, or with the plan
    of another configuration: its ``fingerprint`` is not ``fingerprint``)."""
    plan = read_plan(outdir)
    if not plan or (fingerprint is not None and plan.get("fingerprint") != fingerprint):
        return None
    return PlannedWork.from_plan(plan)


def prediction_section(plan: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """The plan's predictions beside what the run did (``report["prediction"]``): wall time (the run's work,
    engine start-up excluded, as in ``run.wall_time_s``), prompt and generated tokens, prefix hit rate, the
    engine's steps and preemptions (the simulated schedule: no machine load moves them); and the machine's 1-minute load average when the plan was calibrated and when the run ended (a shared machine's
    other load changes the job's speed: the usual reason a run leaves its range).

    A run that did only part of the planned rows (a resumed run, after an earlier one did the rest) is compared
    with that part of the plan: the plan's wall time, range, tokens, steps and preemptions scaled by the rows
    this run did over the plan's rows (``fraction_of_plan``; absent when the run did them all)."""
    p = dict(plan.get("predicted") or {})
    run, tok = report.get("run") or {}, report.get("tokens") or {}
    planned_rows = (plan.get("rows") or {}).get("total") or 0
    run_rows = run.get("rows")
    frac = None
    if planned_rows and run_rows is not None and 0 <= run_rows < planned_rows:
        frac = run_rows / planned_rows
        if p.get("wall_time_s") is not None:
            p["wall_time_s"] = p["wall_time_s"] * frac
        for key in ("prompt_tokens", "prompt_tokens_to_compute", "output_tokens"):
            if p.get(key) is not None:
                p[key] = round(p[key] * frac)
        if p.get("wall_time_range_s"):
            p["wall_time_range_s"] = [x * frac for x in p["wall_time_range_s"]]
        if p.get("schedule"):
            p["schedule"] = {k: (round(v * frac) if k in ("steps", "preemptions") and v is not None else v)
                             for k, v in p["schedule"].items()}  # fmt: skip
    rng = p.get("wall_time_range_s")
    actual_wall = run.get("wall_time_s")
    pooled = (report.get("pooling") or {}).get("prompt_tokens")  # a pooling run: the tokens it pooled (an
    # encoder runs outside the engine, whose token counts stay 0)
    out: dict[str, Any] = {
        "plan_created": plan.get("created"),
        "wall_time_s": {"predicted": p.get("wall_time_s"), "range": rng, "actual": actual_wall},
        "prefix_hit_rate": {"predicted": p.get("prefix_hit_rate"), "actual": tok.get("prefix_hit_rate")},
        "prompt_tokens": {
            "predicted": p.get("prompt_tokens"),
            "actual": tok.get("prompt_admitted") or pooled,
        },
        "prompt_tokens_computed": {
            "predicted": p.get("prompt_tokens_to_compute"),
            "actual": tok.get("prompt_computed") or pooled,  # an encoder's pooling computes every token
        },
        "generated_tokens": {"predicted": p.get("output_tokens"), "actual": tok.get("generated")},
        "startup_s": {"predicted": p.get("startup_s"), "actual": report.get("startup_s")},
    }
    if frac is not None:
        out["fraction_of_plan"] = frac
    sched, sim = report.get("scheduler") or {}, p.get("schedule") or {}
    if sim:
        out["engine_steps"] = {"predicted": sim.get("steps"), "actual": sched.get("steps")}
        out["preemptions"] = {"predicted": sim.get("preemptions"), "actual": sched.get("preemptions")}
    cal = plan.get("calibration") or {}
    # over replicas, the threads each replica computed with (the coordinator computes nothing)
    replica_threads = {r.get("threads") for r in report.get("replicas") or []} - {None}
    run_threads = max(replica_threads) if replica_threads else compute_threads()
    out["load"] = {"plan": cal.get("load"), "run": load_average(), "cpus": cal.get("cpus") or os.cpu_count(),
                   "threads_plan": cal.get("threads"), "threads_run": run_threads}  # fmt: skip
    pw = p.get("wall_time_s")
    if pw and actual_wall:
        out["wall_time_s"]["error"] = (pw - actual_wall) / actual_wall
        if rng:
            out["wall_time_s"]["inside_range"] = rng[0] <= actual_wall <= rng[1]
    ph, ah = p.get("prefix_hit_rate"), tok.get("prefix_hit_rate")
    if ph is not None and ah is not None:
        out["prefix_hit_rate"]["difference"] = ph - ah
    return out


def _num(x: Any, fmt: str = ".0f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "?"
    return format(x, fmt)


def _dur(s: float | None) -> str:
    if s is None or s != s:
        return "?"
    if s < 60:
        return f"{s:.1f} s"
    h, rem = divmod(int(s), 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def prediction_lines(pred: dict[str, Any]) -> list[tuple[str, str]]:
    """Rows of the report table for its ``prediction`` section."""
    w, h = pred["wall_time_s"], pred["prefix_hit_rate"]
    lines = []
    if pred.get("fraction_of_plan") is not None:
        lines.append(("planned for this run", f"{pred['fraction_of_plan']:.0%} of the plan's rows (the rest "
                      "done before): its figures below are scaled to them"))  # fmt: skip
    if w.get("predicted") is not None:
        rng = w.get("range") or [None, None]
        inside = "" if "inside_range" not in w else (" (inside)" if w["inside_range"] else " (outside)")
        err = f", {w['error']:+.0%}" if "error" in w else ""
        load = pred.get("load") or {}
        at = ""
        if load.get("plan") is not None and load.get("run") is not None:
            at = f"; load {load['plan']:.1f} at plan, {load['run']:.1f} at run on {load.get('cpus')} CPUs"
        tp, tr = load.get("threads_plan"), load.get("threads_run")
        if tp is not None and tr is not None and tp != tr:  # the thread policy saw other loads: a usual miss
            at += f"; calibrated on {tp} thread(s), ran on {tr}"
        lines.append(("planned wall time", f"{_dur(w['predicted'])} [{_dur(rng[0])} - {_dur(rng[1])}]; "
                      f"actual {_dur(w.get('actual'))}{err}{inside}{at}"))  # fmt: skip
    if h.get("predicted") is not None:
        lines.append(
            ("planned prefix hit rate", f"{h['predicted']:.1%}; actual {_num(h.get('actual'), '.1%')}")
        )
    su = pred.get("startup_s") or {}
    if su.get("predicted") is not None:
        lines.append(("planned start-up", f"{_dur(su['predicted'])}; actual {_dur(su.get('actual'))}"))
    g = pred.get("generated_tokens") or {}
    if g.get("predicted") is not None:
        lines.append(("planned generated tokens", f"{_num(g['predicted'])}; actual {_num(g.get('actual'))}"))
    st, pre = pred.get("engine_steps") or {}, pred.get("preemptions") or {}
    if st.get("predicted") is not None:
        lines.append(("planned engine steps", f"{_num(st['predicted'])} ({_num(pre.get('predicted'))} preemptions); "
                      f"actual {_num(st.get('actual'))} ({_num(pre.get('actual'))})"))  # fmt: skip
    return lines


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as the dry run prints it."""
    rows, tok, pred = plan["rows"], plan["prompt_tokens"], plan["predicted"]
    lines: list[tuple[str, str]] = [
        ("model", str(plan.get("model"))),
        ("shard", f"{plan['shard']['index']}/{plan['shard']['count']}: rows [{plan['shard']['row_start']}, "
                  f"{plan['shard']['row_end']}), {plan['shard']['windows']} window(s)"),  # fmt: skip
        ("rows", f"{rows['total']} ({rows['valid']} valid, {rows['error']} would be error rows)"
         + (f"; {rows['sampled']} tokenized, totals scaled" if rows.get("sampled") != rows["total"] else "")),
    ]  # fmt: skip
    resume = plan.get("resume")
    if resume:
        lines.append(("resumed", f"{resume['note']} ({resume['windows_done']} of {resume['windows']} window(s) "
                      "committed)"))  # fmt: skip
    for reason, e in (plan.get("errors") or {}).items():
        ids = ", ".join(str(i) for i in e["first_ids"])
        lines.append(("  error rows", f"{e['rows']} x {reason} (ids {ids})"))
    for warning in plan.get("warnings") or []:
        lines.append(("  warning", warning))
    lines += [
        ("prompt tokens", f"{_num(tok['total'])} (p50 {_num(tok['p50'])}, p90 {_num(tok['p90'])}, "
                          f"p99 {_num(tok['p99'])}, max {_num(tok['max'])})"),
        ("prompt tokens to compute", f"{_num(pred['prompt_tokens_to_compute'])} after prefix sharing, with preemptions' recompute "
                                     f"(predicted prefix hit rate {pred['prefix_hit_rate']:.1%})"),
    ]  # fmt: skip
    for note in (plan.get("sharing") or {}).get("notes") or []:
        lines.append(("  sharing", note))
    out = plan.get("output_tokens")
    if out is not None:  # a generation job (a pooling job generates nothing)
        lines.append(("output tokens", f"bound {_num(out.get('bound'))}, expected {_num(pred.get('output_tokens'))}"
                      + (f" ({out['source']})" if out.get("source") else "")))  # fmt: skip
    mem = plan.get("memory") or {}
    if "kv_bytes_per_token" in mem:  # a generation job's KV cache
        lines.append(("KV cache", f"{_num(mem.get('kv_bytes_per_token'))} bytes/token "
                      f"(kv_cache_dtype {mem.get('kv_cache_dtype', 'auto')}); pool of "
                      f"{_num(mem.get('kv_pool_tokens'))} tokens holds {_num(mem.get('sequences_that_fit'))} "
                      "average sequences"))  # fmt: skip
    rec = plan.get("recommended") or {}
    if rec:
        lines.append(("recommended", ", ".join(f"{k}={v}" for k, v in rec.items())))
    rng = pred.get("wall_time_range_s") or [None, None]
    if pred.get("startup_s") is not None:
        lines.append(("start-up", f"{_dur(pred['startup_s'])} (opening, the first window and the engine, as "
                      "measured by this dry run)"))  # fmt: skip
    lines.append(("predicted wall time", f"{_dur(pred.get('wall_time_s'))} [{_dur(rng[0])} - {_dur(rng[1])}]"
                  + (f", {pred['device_hours']:.4g} device-hours" if pred.get("device_hours") is not None else "")
                  + (f", cost {pred['cost']:.4g}" if pred.get("cost") is not None else "")))  # fmt: skip
    sim = pred.get("schedule")
    if sim:
        lines.append(("simulated schedule", f"{_num(sim.get('steps'))} engine steps, {_num(sim.get('preemptions'))} "
                      f"preemptions, at most {_num(sim.get('peak_running_seqs'))} sequences"
                      + (f" and {sim['peak_kv_blocks']} KV blocks" if sim.get("peak_kv_blocks") else "")))  # fmt: skip
    alls = pred.get("all_shards")
    if alls:
        lines.append(("all shards", f"{alls['shards']} shards, {alls['rows']} rows: about "
                      f"{alls['device_hours']:.4g} device-hours" + (f", cost {alls['cost']:.4g}" if alls.get("cost")
                                                                     is not None else "")))  # fmt: skip
    cal = plan.get("calibration") or {}
    if cal:
        load = f", load {cal['load']:.1f} on {cal.get('cpus')} CPUs" if cal.get("load") is not None else ""
        share = cal.get("fraction_of_predicted")
        share = f" ({share:.1%} of the predicted time)" if share is not None else ""
        lines.append(("calibration", f"{cal.get('rows', 0)} rows in {_dur(cal.get('seconds'))}{share} on "
                      f"{cal.get('device')}{load}" + (f" ({cal['note']})" if cal.get("note") else "")))  # fmt: skip
    for sh in plan.get("shards") or []:
        lines.append((f"shard {sh['index']}", f"{sh['rows']} rows, {_dur(sh['wall_time_s'])}"))
    w = max(len(k) for k, _ in lines)
    bar = "-" * (w + 2 + max(len(v) for _, v in lines))
    body = "\n".join(f"{k.ljust(w)}  {v}" for k, v in lines)
    return f"{bar}\n{body}\n{bar}"
