#!/usr/bin/env python3
"""Sim-to-real check (`make sim-to-real`): does the simulator predict the real engine?

Runs the quickstart for real at one setting (the calibration), derives a simulation spec from
it with `rollarc profile`, then runs the quickstart for real at other settings and simulates
the profiled spec at the same settings, without re-calibrating. Prints predicted against
measured mean step time and trajectories/s (steps after the first), and writes
report/sim-to-real/results.json.

Usage: python3 envs/sim_to_real.py [--steps N] [--out DIR] [--reuse-real]
"""

import argparse
import json
import os
import sqlite3
import subprocess
import sys

ROLLARC = "./target/release/rollarc"

# (name, preset, batch size); the first is the calibration.
SETTINGS = [
    ("rollarc-b12", "rollarc", 12),
    ("sync-b12", "sync", 12),
    ("rollarc-b24", "rollarc", 24),
    ("sync-b24", "sync", 24),
]


def sets(preset, batch, steps):
    return [
        "--set", f"preset={preset}",
        "--set", f"rollout.batch_size={batch}",
        "--set", f"rollout.steps={steps}",
        "--set", f"trainer.decay_steps={steps}",
    ]


def measured(data_dir):
    """Mean step time and trajectories/s over the steps after the first, from the store."""
    db = sqlite3.connect(os.path.join(data_dir, "rollarc.db"))
    rows = [json.loads(m) for (m,) in db.execute("SELECT metrics FROM step_metrics ORDER BY step")]
    after = [m for m in rows if m["step"] > 1] or rows  # steps count from 1
    step_s = sum(m["step_s"] for m in after) / len(after)
    traj_s = sum(m["trajectories"] for m in after) / sum(m["step_s"] for m in after)
    return step_s, traj_s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="report/sim-to-real")
    ap.add_argument("--reuse-real", action="store_true",
                    help="keep the real runs already in OUT/data (re-profile and re-simulate only)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    real = {}
    for name, preset, batch in SETTINGS:
        data = os.path.join(a.out, "data", name)
        if a.reuse_real and os.path.isfile(os.path.join(data, "rollarc.db")):
            real[name] = measured(data)
            continue
        subprocess.run(["rm", "-rf", data], check=True)
        print(f"real run {name} …", flush=True)
        subprocess.run(
            [ROLLARC, "run", "examples/quickstart.toml", *sets(preset, batch, a.steps),
             "--data-dir", data, "--report", os.path.join(a.out, "report", name)],
            check=True, stdout=subprocess.DEVNULL,
        )
        real[name] = measured(data)
    calib = SETTINGS[0][0]
    profiled = os.path.join(a.out, "profiled.json")
    subprocess.run(
        [ROLLARC, "profile", "job-1", "--data-dir", os.path.join(a.out, "data", calib),
         "--out", profiled],
        check=True,
    )
    # Every setting simulated from the one profile: a scenario over the profiled spec.
    spec = json.load(open(profiled))
    scenario = os.path.join(a.out, "scenario.toml")
    sc = {
        "scenario": {"name": "sim-to-real", "title": "profiled quickstart",
                     "figure": f"calibrated on {calib}", "warmup_steps": 1},
        "base": spec,
        "runs": [
            {"name": name, "set": {"preset": preset, "rollout.batch_size": batch,
                                   "rollout.steps": a.steps}}
            for name, preset, batch in SETTINGS
        ],
    }
    with open(scenario, "w") as f:
        f.write(to_toml(sc))
    out_json = os.path.join(a.out, "simulated.json")
    subprocess.run(
        [ROLLARC, "scenario", scenario, "--quiet",
         "--json-out", out_json],
        check=True, stdout=subprocess.DEVNULL,
    )
    sim = {r["name"]: (r["metrics"]["step_s"], r["metrics"]["throughput"])
           for r in json.load(open(out_json))["runs"]}
    results = []
    print(f"\ncalibrated on {calib} ({a.steps} steps each; means over steps after the first)")
    print(f"{'setting':<14} {'step s real':>11} {'sim':>7} {'error':>7}   "
          f"{'traj/s real':>11} {'sim':>7} {'error':>7}")
    worst = 0.0
    for name, _, _ in SETTINGS:
        (rs, rt), (ss, st) = real[name], sim[name]
        es, et = (ss - rs) / rs, (st - rt) / rt
        if name != calib:
            worst = max(worst, abs(es), abs(et))
        results.append({"setting": name, "calibration": name == calib,
                        "step_s": {"real": rs, "sim": ss, "error": es},
                        "trajectories_per_s": {"real": rt, "sim": st, "error": et}})
        print(f"{name:<14} {rs:>11.3f} {ss:>7.3f} {100*es:>+6.1f}%   "
              f"{rt:>11.2f} {st:>7.2f} {100*et:>+6.1f}%")
    print(f"largest error off the calibration: {100*worst:.1f} % (target 15 %)")
    json.dump({"calibration": calib, "steps": a.steps, "results": results,
               "worst_error": worst}, open(os.path.join(a.out, "results.json"), "w"), indent=2)
    return 0 if worst <= 0.15 else 1


def to_toml(v, path=()):
    """A small TOML writer for the scenario (tables, arrays of tables, inline values)."""
    out = []

    def inline(x):
        if isinstance(x, bool):
            return "true" if x else "false"
        if isinstance(x, (int, float)):
            return repr(x)
        if isinstance(x, str):
            return json.dumps(x)
        if x is None:
            raise ValueError("TOML has no null")
        if isinstance(x, list):
            return "[" + ", ".join(inline(i) for i in x) + "]"
        return "{ " + ", ".join(f"{json.dumps(k)} = {inline(i)}"
                                for k, i in x.items() if i is not None) + " }"

    def table(d, name):
        scalars = {k: x for k, x in d.items() if x is not None
                   and not (isinstance(x, dict) or (isinstance(x, list) and x
                                                    and all(isinstance(i, dict) for i in x)))}
        if name:
            out.append(f"[{name}]")
        for k, x in scalars.items():
            out.append(f"{json.dumps(k)} = {inline(x)}")
        out.append("")
        for k, x in d.items():
            key = f"{name}.{json.dumps(k)}" if name else json.dumps(k)
            if isinstance(x, dict):
                table(x, key)
            elif isinstance(x, list) and x and all(isinstance(i, dict) for i in x):
                for i in x:
                    out.append(f"[[{key}]]")
                    for k2, x2 in i.items():
                        if x2 is not None:
                            out.append(f"{json.dumps(k2)} = {inline(x2)}")
                    out.append("")

    table(v, "")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
