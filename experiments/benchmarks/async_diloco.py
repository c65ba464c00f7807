"""Decoupled (asynchronous) DiLoCo vs lock-step Streaming DiLoCo, as processes on a rate-limited link.

    python -m experiments.benchmarks.async_diloco                    # every row (root: unshare -n and tc)
    python -m experiments.benchmarks.async_diloco --publish --wait-load 1.5   # experiments/results/benchmarks/
    python -m experiments.benchmarks.async_diloco --quick            # 2 learners, 2 rows, no shaping (~1 min)
    python -m experiments.benchmarks.async_diloco --publish --report-only     # the tables again from the JSON

Every row is one run of :mod:`experiments.async_diloco`: a syncer process and 4 learner processes of
the character transformer (``tiny``, 112,512 parameters) on Tiny Shakespeare, every learner taking the
same number of inner steps (AdamW, 16 windows of 64 characters each), Streaming DiLoCo's 4 fragments
with ``H = 200``, outer gradients compressed with 4-bit E3M0 (error feedback on the learner).  The rows:

* **lock-step**: lock-step Streaming DiLoCo with the same processes and code: ``min_quorum`` = every
  learner, no grace limit, and each learner waits for its merged fragment before its next inner step
  (these settings compute :func:`compjax.diloco`'s global parameters; ``tests/test_decoupled_equivalence.py``);
* **async**: the asynchronous system: sends overlap the next inner steps, a quorum of every live learner
  (``quorum_fraction`` 1.0: it follows losses, leaves and joins) within an 8 s grace window (two thirds of
  the period of a fragment's sends here: a round merges with fewer only when not every live learner's
  contribution came within it, so a straggler or a dead learner holds no merge longer than that; with
  paced learners, which reach a fragment's send together, a quorum of 3 of 4 (``quorum_fraction`` 0.75)
  merged the first three and left the fourth's contribution alone in a round of its own every time: 24 of
  48 merges had one contributor and the loss ended 30% above lock-step's),
  ``max_staleness`` 4 with ``staleness_decay`` 0.5 (a contribution that missed its round is merged in a
  later one, its outer gradient scaled by ``e^{-0.5 tau}``, CGAD), ``partial_rounds="share"`` (a round of
  3 of 4 learners moves the model by 3/4 of a full round's step: with a full step per partial round the
  model moved several outer steps per period and a trial run's loss ended 40% above lock-step's), the
  outer optimizer Nesterov SGD stepping its momentum at every merge (``--outer nesterov``; with
  ``--outer delayed``, :func:`compjax.decoupled.delayed_nesterov`, stepping it once per full round's share, a
  full run ended at 2.304 against lock-step's 2.218 at 10 Mbit/s and 2.250 against 2.119 at 100 Mbit/s, and a
  trial at 2.334: fewer momentum steps in a run of 6 to 9 outer steps per fragment),
  replies compressed (``--reply-compressor bfloat16``: each merge's outer update as
  bfloat16, which the syncer applies to its own global values exactly as sent, so every learner stays
  bit-identical to it; lock-step rows keep whole float32 replies), ``alpha`` 0.5, ``late_reply="wait"`` (a fragment due again before its merge came
  back waits for it: with ``"defer"`` a trial run kept 84-87% goodput at 10 Mbit/s but merged fewer rounds,
  20 of 24, and its global loss was 8% above lock-step's);
* both at 10 and 100 Mbit/s, and lock-step on the unshaped loopback (its wait is then stragglers and merges,
  not the link: with the shaped rows it splits lock-step's loss into link wait and straggler wait);
* **straggler** (async, 10 Mbit/s): one learner 2x slower (its steps paced to twice the others' wall
  time); it stops when the others are done;
* **lock-step straggler** (10 Mbit/s): the same 2x slower learner in lock-step, taking the same steps as
  the others (every merge waits for it): the system throughput to compare the straggler row with;
* **fault** (async, 10 Mbit/s): one learner killed with SIGKILL at 1/3 of its steps and restarted at once
  as a new process (a new name: it compiles, joins from the global model and trains until the others are
  done; what the kill loses is its work in flight and the restart's compile and join); and the syncer
  stopped with SIGTERM (its checkpoint) when the others reached 1/2 and restarted through the launcher's own
  ``--resume`` as soon as its checkpoint is on disk (the stopped process then evaluates its validation curve
  for this benchmark meanwhile; its record joins the successor's: merges, refusals, carried bytes).

**Paced learners.**  The rows share one machine's cores, so a learner's inner step is slower when more of
them compute at once: in an unpaced trial the lock-step straggler row's steps took 27.7 ms (the others
idle while they wait for the straggler) against 35.6 ms in the asynchronous straggler row, which by
itself took a quarter off the asynchronous gain.  Every learner is therefore paced (``step_time_s``,
``--step-time-s`` of :mod:`experiments.async_diloco`): each inner step is padded to 60 ms of wall time
(120 ms for the 2x straggler), longer than its compute on this machine (the tables give the mean compute
and the share of steps whose compute alone took longer than the pace), so every learner runs at a fixed
speed, as on a machine of its own, and the rows differ only in what they wait for.

**The link.**  Needs root (or CAP_SYS_ADMIN + CAP_NET_ADMIN): the rows run inside a fresh network
namespace (``unshare -n``) whose loopback has a 1500-byte MTU and a token bucket of the row's rate
(``tc qdisc ... tbf``, as :mod:`experiments.benchmarks.link`); every process's packets, the syncer's
replies included, cross that one bucket.  Where that is not permitted the script says so in one line
and exits 0.  ``--quick`` runs 2 learners on the loopback as it is (no namespace, no kernel bytes).

**Measured**, per learner: *goodput*, the fraction of its wall time from its first inner step to the end
of its last spent inside inner steps (``stats.step_seconds`` and the pacing's padding: a paced step's wall
time; waits for merges and replies are not steps), and beside it the *drain*, the wait in
:meth:`~compjax.decoupled.Learner.finish` for the replies still in flight after the last step (the end of
a finite run: a learner that goes on training never drains), with the goodput counting it too; tokens/s over
the same wall time; the bytes counted for its contributions
(:func:`compjax.decoupled.message_bytes`, the compressor's message size).  Per row: the validation loss of
the global model (the syncer's global parameters, on fixed windows of the validation split) over the run
and at its end; the bytes the transport *carried* (the syncer's side: the arrays of every contribution it
pulled, of every reply and every welcome, the offers handed back unpulled, and its JSON control frames);
and the *kernel* bytes: ``tc -s qdisc`` "Sent N bytes M pkt" over the training, less an idle baseline
(the same processes joined and idle before training: heartbeats) scaled to the training's duration.
*Framing* is the TCP/IP/Ethernet headers of the packets the kernel counted (66 bytes each,
:data:`compjax.netmodel.Framing.gloo_tcp`'s ``segment_header``); the ratio ``kernel / (carried +
framing)`` is the part of the traffic that the carried bytes and headers do not explain (the transfer
protocol's own messages).

**Targets** (the markdown opens with them, each met or not): at 10 Mbit/s every asynchronous learner's
goodput >= 85% where lock-step's is lower; with the straggler the other learners' tokens/s >= 90% of the
no-straggler run's, and the asynchronous system throughput (all tokens over the time to the last learner's
last step) >= 1.3x lock-step's with the same straggler; the global validation loss within 2% of lock-step's at the same tokens (10 and 100
Mbit/s); the fault run's final loss within 3% of the no-fault run's (the two loss targets one-sided: a lower
loss is within); kernel bytes within 10% of carried + framing.

Writes ``async_diloco.json`` (every measurement, the command, provenance), ``async_diloco.md`` and
``async_diloco.png`` to ``runs/benchmarks`` (git-ignored), with ``--publish`` to
``experiments/results/benchmarks``, or to ``--out-dir``.  The data: ``--text FILE`` (any text), else
``$COMPJAX_TINYSHAKESPEARE`` or the download cache (:mod:`experiments.lm.data`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.async_diloco import child_env, learner_name
from experiments.benchmarks.link import MTU, permitted, provenance, set_rate, tc_counters, wait_for_load

PROG = "python -m experiments.benchmarks.async_diloco"
REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "runs" / "benchmarks"
PUBLISHED = REPO / "experiments" / "results" / "benchmarks"
NAME = "async_diloco"
#: Header bytes per packet as ``tc`` counts them: Ethernet 14 + IPv4 20 + TCP with timestamps 32.
SEGMENT_HEADER = 66
RATES = {"10 Mbit/s": 10e6, "100 Mbit/s": 100e6, "unshaped": None}

#: The run's settings (``--quick`` changes some): passed to every process of :mod:`experiments.async_diloco`.
FULL = {"learners": 4, "steps": 1200, "sync_every": 200, "fragments": 4, "compressor": "e3m0", "batch": 16,
        "seq_len": 64, "grace_s": 8.0, "quorum_fraction": 1.0, "max_staleness": 4, "staleness_decay": 0.5, "partial_rounds": "share",
        "outer": "nesterov", "alpha": 0.5,
        "late_reply": "wait", "reply_compressor": "bfloat16",
        "heartbeat_timeout_s": 5.0, "step_time_s": 0.06,
        "log_every": 25, "eval_batches": 16}
QUICK = {**FULL, "learners": 2, "steps": 60, "sync_every": 20, "fragments": 2, "log_every": 10, "eval_batches": 4,
         "step_time_s": 0.1}

#: Rows: name -> (rate, mode).  Modes: lockstep, lockstep-straggler, async, straggler, fault.
ROWS = {
    "lock-step unshaped": ("unshaped", "lockstep"),
    "lock-step 100 Mbit/s": ("100 Mbit/s", "lockstep"),
    "async 100 Mbit/s": ("100 Mbit/s", "async"),
    "lock-step 10 Mbit/s": ("10 Mbit/s", "lockstep"),
    "async 10 Mbit/s": ("10 Mbit/s", "async"),
    "lock-step straggler 10 Mbit/s": ("10 Mbit/s", "lockstep-straggler"),
    "straggler 10 Mbit/s": ("10 Mbit/s", "straggler"),
    "fault 10 Mbit/s": ("10 Mbit/s", "fault"),
}
QUICK_ROWS = {"lock-step unshaped": ("unshaped", "lockstep"), "async unshaped": ("unshaped", "async")}
#: The learner made 2x slower in the straggler row, the one killed in the fault row, and the one that joins.
STRAGGLER, VICTIM = 3, 1


def row_dir(work: Path, name: str) -> Path:
    """The row's folder under ``work``, emptied: a control file (go, ready, join, stop) left by an earlier run
    in the same ``--log-dir`` would start, join or stop this run's processes early."""
    out = work / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


def settings_args(settings: dict) -> list[str]:
    """``settings`` as command-line options of :mod:`experiments.async_diloco`."""
    return [x for k, v in settings.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def _progress(log: Path) -> int:
    """The last inner step a learner's log reports (0 if none yet)."""
    try:
        steps = re.findall(r"^learner \S+ step (\d+) ", log.read_text(), re.MULTILINE)
    except OSError:
        return 0
    return int(steps[-1]) if steps else 0


def _free_address() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def run_row(name: str, rate: str, mode: str, settings: dict, args, work: Path) -> dict:
    """One row: start the syncer and the learners, baseline, train, collect; the raw measurements."""
    out = row_dir(work, name)
    lockstep = mode.startswith("lockstep")
    if lockstep:  # whole float32 replies: the settings that compute cj.diloco's global parameters
        settings = {**settings, "reply_compressor": "none"}
    n, steps = settings["learners"], settings["steps"]
    bits = RATES[rate]
    shaped = args.shape and bits is not None
    if shaped:
        set_rate(bits)
    elif args.shape:
        set_rate(None)
    py = [sys.executable, "-m", "experiments.async_diloco"]
    common = [*settings_args(settings), "--address", _free_address(), "--out", str(out)]
    if lockstep:
        common.append("--lockstep")
    if args.text:
        common += ["--text", str(args.text)]
    env = child_env()
    procs, logs = {}, {}

    def start(role: str, key: str, extra: list[str]) -> None:
        logs[key] = out / f"{key}.log"
        with open(logs[key], "w") as f:
            procs[key] = subprocess.Popen([*py, role, *common, *extra], cwd=REPO, env=env, stdout=f,
                                          stderr=subprocess.STDOUT, start_new_session=True)

    go = out / "go"
    start("syncer", "syncer", [])
    for i in range(n):
        extra = ["--index", str(i), "--ready-file", str(out / f"ready{i}"), "--go-file", str(go)]
        if mode == "straggler":
            extra += ["--stop-file", str(out / "stop")]
            if i == STRAGGLER:
                extra += ["--slowdown", "1", "--steps", str(10 * steps)]  # runs until the others are done
        elif mode == "lockstep-straggler" and i == STRAGGLER:  # the same steps: every merge waits for it
            extra += ["--slowdown", "1"]
        start("learner", learner_name(i), extra)
    joiner = learner_name(n)  # the killed learner's replacement (a new process, started when it is killed)
    joiner_runs = mode == "fault" and "learner" in args.fault_parts
    events: dict = {}
    try:
        deadline = time.monotonic() + args.row_timeout_s
        while not all((out / f"ready{i}").exists() for i in range(n)):
            dead = [k for k, p in procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: {dead or 'time-out'} before every learner joined")
            time.sleep(0.1)
        c0, t0 = tc_counters() if args.shape else None, time.time()
        time.sleep(args.idle_s)
        c1, t1 = tc_counters() if args.shape else None, time.time()
        go.write_text("go")
        t_go = time.time()
        learners = [learner_name(i) for i in range(n)]
        others = [k for i, k in enumerate(learners) if not (mode == "straggler" and i == STRAGGLER)]
        if mode == "fault":
            others = [k for i, k in enumerate(learners) if i != VICTIM]
        while any(procs[k].poll() is None for k in [*learners, *([joiner] if joiner in procs else [])]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: longer than {args.row_timeout_s} s")
            if mode == "fault":
                victim = learners[VICTIM]
                if joiner_runs and "killed" not in events and _progress(logs[victim]) >= steps // 3:
                    procs[victim].send_signal(signal.SIGKILL)
                    events["killed"] = {"learner": victim, "t": time.time() - t_go, "step": _progress(logs[victim])}
                    # Its restart: a new process (it compiles, then joins from the global model at once) that
                    # trains until the others are done.
                    start("learner", joiner, ["--index", str(n), "--steps", str(steps), "--stop-file",
                                              str(out / "stop")])
                    events["restarted"] = {"learner": joiner, "t": time.time() - t_go}
                if joiner in procs and "joined" not in events:
                    if re.search(rf"^learner {joiner} joined", logs[joiner].read_text(), re.MULTILINE):
                        events["joined"] = {"learner": joiner, "t": time.time() - t_go,
                                            "others_step": min(_progress(logs[k]) for k in others)}
                    elif procs[joiner].poll() is not None:
                        raise RuntimeError(f"{name}: the restarted learner exited before it joined")
                if (joiner in procs and "stopped" not in events
                        and all(procs[k].poll() is not None for k in others)):
                    (out / "stop").write_text("stop")
                    events["stopped"] = {"learner": joiner, "t": time.time() - t_go, "step": _progress(logs[joiner])}
                if ("syncer" in args.fault_parts and "syncer_stopped" not in events
                        and min(_progress(logs[k]) for k in others) >= steps // 2):
                    # The syncer killed (SIGTERM: its checkpoint) and restarted through the launcher's --resume.
                    events["syncer_stopped"] = {"t": time.time() - t_go,
                                                "others_step": min(_progress(logs[k]) for k in others)}
                    procs["syncer"].send_signal(signal.SIGTERM)
                    # The successor starts once the stopped syncer's checkpoint is on disk (its port closed
                    # before): what the stopped process does after that, evaluating its validation curve for this
                    # benchmark and writing its record, is the benchmark's work, not the syncer's.
                    stopping = time.monotonic() + 300
                    while (procs["syncer"].poll() is None and time.monotonic() < stopping
                           and not re.search(r"^syncer checkpoint \d+ \(stopped\)", logs["syncer"].read_text(),
                                             re.MULTILINE)):
                        time.sleep(0.02)
                    logs.pop("syncer").rename(out / "syncer-before-restart.log")  # it goes on writing there
                    logs["syncer-before-restart"] = out / "syncer-before-restart.log"
                    procs["syncer-before-restart"] = procs.pop("syncer")
                    start("syncer", "syncer", ["--resume"])
                    events["syncer_restarted"] = {"t": time.time() - t_go}
            if "syncer-before-restart" in procs:
                record_of_stopped_syncer(procs["syncer-before-restart"], out, wait=False)
            if mode == "straggler" and "stopped" not in events and all(procs[k].poll() is not None for k in others):
                (out / "stop").write_text("stop")
                events["stopped"] = {"learner": learners[STRAGGLER], "t": time.time() - t_go,
                                     "step": _progress(logs[learners[STRAGGLER]])}
            time.sleep(0.05)
        c2, t_end = tc_counters() if args.shape else None, time.time()
        if "syncer-before-restart" in procs:  # its record is out of the way before the successor writes its own
            record_of_stopped_syncer(procs["syncer-before-restart"], out, wait=True)
        procs["syncer"].send_signal(signal.SIGTERM)
        procs["syncer"].wait(timeout=300)
        failed = [k for k, p in procs.items() if p.returncode not in (0, -signal.SIGKILL)]
        if failed:
            raise RuntimeError(f"{name}: {failed} failed")
    except Exception as e:
        tails = "".join(f"\n--- {k}\n{p.read_text()[-2500:]}" for k, p in logs.items() if p.exists())
        raise RuntimeError(f"{e}{tails}") from e
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    syncer = json.loads((out / "syncer.json").read_text())
    if (out / "syncer-before-restart.json").exists():
        syncer = join_syncers(json.loads((out / "syncer-before-restart.json").read_text()), syncer)
    per = []
    for k in [*learners, *([joiner] if joiner_runs else [])]:
        path = out / f"{k}.json"
        if path.exists():
            per.append(json.loads(path.read_text()))
        else:  # killed: what its log says
            per.append({"name": k, "killed": True, "steps": _progress(logs[k])})
    row = {"name": name, "rate": rate, "bits_per_s": bits, "mode": mode, "settings": settings, "t_go": t_go,
           "duration_s": t_end - t_go, "events": events, "learners": per, "syncer": syncer}
    if args.shape:
        idle = t1 - t0
        row["idle"] = {"s": idle, "bytes": c1["bytes"] - c0["bytes"], "packets": c1["packets"] - c0["packets"]}
        row["tc"] = {"bytes": c2["bytes"] - c1["bytes"] - (c1["bytes"] - c0["bytes"]) * (t_end - t1) / idle,
                     "packets": c2["packets"] - c1["packets"] - (c1["packets"] - c0["packets"]) * (t_end - t1) / idle,
                     "dropped": c2["dropped"] - c0["dropped"], "window_s": t_end - t1}
    return row


def record_of_stopped_syncer(proc, out: Path, *, wait: bool) -> None:
    """Once the syncer stopped in the fault row has exited, move its ``syncer.json`` to
    ``syncer-before-restart.json`` (its successor writes ``syncer.json`` only when it stops, at the row's end)."""
    if wait:
        proc.wait(timeout=300)
    if proc.poll() is not None and (out / "syncer.json").exists() and not (out / "syncer-before-restart.json").exists():
        (out / "syncer.json").rename(out / "syncer-before-restart.json")


def join_syncers(before: dict, after: dict) -> dict:
    """One syncer's record from a syncer's and its restarted successor's (``--resume``): merges, refusals, losses
    and validation curves one after the other, carried bytes summed, the successor's final state."""
    out = dict(after)
    for k in ("merges", "refused", "lost", "val_curve"):
        out[k] = [*before.get(k, []), *after.get(k, [])]
    out["carried"] = {k: (before["carried"][k] + after["carried"][k]) for k in after["carried"]}
    out["restarted"] = {"before_versions": before["versions"], "before_val_loss": before["val_loss"]}
    return out


# ----------------------------------------------------------------------------------------------------------------
# The report.


def lost_while_running(row: dict) -> list[str]:
    """The learners the syncer declared lost before they were done (a learner that finished and closed is
    lost too, after the heartbeat timeout: its last message came at or after its end, less a heartbeat)."""
    ends = {r["name"]: r["started"] + r["wall_s"] for r in row["learners"] if "started" in r}
    return [n for n, seen in row["syncer"]["lost"] if n not in ends or seen < ends[n] - 2.0]


def system_columns(row: dict, tokens: int, live: list[dict]) -> dict:
    """The row's system view: all tokens over the wall time to the last learner's last step, the mean inner step,
    the contributions refused (share and why), the merges by number of contributors, and the learners' wait split.

    The wait split (read in lock-step rows): every learner waits for each merge; the learner that arrives last
    waits only for the link and the merge, so the smallest mean wait is the *link wait* and what the others wait
    beyond it the *straggler wait* (waiting for slower learners).
    """
    timed = [r for r in live if "started" in r]
    ends = [r["started"] + r.get("loop_s", r.get("wall_s", 0.0)) for r in timed]
    span = max(ends) - row["t_go"] if ends else float("nan")
    stepped = [r for r in live if r.get("steps") and "step_s" in r]
    merges = row["syncer"]["merges"]
    refused = row["syncer"]["refused"]
    received = sum(len(k) for _, _, k in merges) + len(refused)
    why = collections.Counter(str(reason).split(":")[0].split(" (")[0] for _, _, reason in refused)
    waits = [r["wait_s"] for r in live if "wait_s" in r]
    link = min(waits) if waits else 0.0
    return {
        "system_tokens_per_s": tokens / span if span and span > 0 else float("nan"),
        "system_span_s": span,
        "step_ms_mean": 1000 * statistics.fmean(r["step_s"] / r["steps"] for r in stepped) if stepped else float("nan"),
        # Paced rows: each step's wall time with its padding (the learners' fixed speed), and the share of steps
        # whose compute alone took longer than the pace (0 where it held).
        "paced_ms_mean": 1000 * statistics.fmean((r["step_s"] + r.get("pad_s", 0.0)) / r["steps"] for r in stepped)
        if stepped else float("nan"),
        "overrun_share": sum(r.get("overruns", 0) for r in stepped) / max(1, sum(r["steps"] for r in stepped)),
        "refused_share": len(refused) / received if received else 0.0,
        "refused_why": dict(sorted(why.items())),
        "merges_by_contributors": {str(n): c for n, c in sorted(collections.Counter(len(k) for _, _, k in merges).items())},
        "link_wait_s": link,
        "straggler_wait_s": statistics.fmean(w - link for w in waits) if waits else 0.0,
    }


def summarize(row: dict) -> dict:
    """A row's derived numbers: goodput and tokens/s per learner, bytes, the kernel's ratio."""
    s = row["settings"]
    tokens_per_step = s["batch"] * s["seq_len"]
    live = [r for r in row["learners"] if not r.get("killed")]
    excluded = {learner_name(STRAGGLER)} if row["mode"] == "straggler" else set()  # lock-step: it sets the pace
    main = [r for r in live if r["name"] not in excluded and r["name"] != learner_name(s["learners"])]
    tokens = sum(r["steps"] * tokens_per_step for r in row["learners"])
    c = row["syncer"]["carried"]
    welcomes = sum(b for t, _, b in c["welcomes"] if t >= row["t_go"])
    carried = c["contributions"] + c["replies"] + c["released"] + welcomes
    out = {
        "name": row["name"], "rate": row["rate"], "mode": row["mode"],
        "goodput": {r["name"]: r["goodput"] for r in live},
        "goodput_min": min(r["goodput"] for r in main), "goodput_mean": statistics.fmean(r["goodput"] for r in main),
        "goodput_with_drain_min": min(r.get("goodput_with_drain", r["goodput"]) for r in main),
        "drain_s_mean": statistics.fmean(r.get("drain_s", 0.0) for r in main),
        "tokens_per_s": {r["name"]: r["tokens_per_s"] for r in live},
        "tokens_per_s_mean": statistics.fmean(r["tokens_per_s"] for r in main),
        "tokens": tokens, "steps": {r["name"]: r["steps"] for r in row["learners"]},
        "val_loss": row["syncer"]["val_loss"], "versions": row["syncer"]["versions"],
        "merges": len(row["syncer"]["merges"]), "refused": len(row["syncer"]["refused"]),
        "lost": [n for n, _ in row["syncer"]["lost"]],
        "lost_running": lost_while_running(row),
        "counted_bytes": sum(sum(r["bytes_sent"]) for r in live),
        "reply_compressor": s.get("reply_compressor", "none"),
        "replies_counted": sum(row["syncer"].get("reply_bytes_counted", [])),
        "contributions_carried": c["contributions"], "replies_carried": c["replies"],
        "carried_bytes": carried, "control_bytes": c["control"],
        "delay_mean": statistics.fmean([d for r in live for f in r["delays"] for d in f] or [0]),
        "wait_s_mean": statistics.fmean(r["wait_s"] for r in main), "duration_s": row["duration_s"],
        **system_columns(row, tokens, live),
    }
    if "tc" in row:
        framing = row["tc"]["packets"] * SEGMENT_HEADER
        out.update(kernel_bytes=row["tc"]["bytes"], kernel_packets=row["tc"]["packets"], framing_bytes=framing,
                   kernel_ratio=row["tc"]["bytes"] / (carried + c["control"] + framing), dropped=row["tc"]["dropped"])
    return out


def targets(rows: dict) -> list[dict]:
    """The issue's targets, each with what was measured and whether it was met (None: its rows are missing)."""
    t = []

    def add(target, measured, met):
        t.append({"target": target, "measured": measured, "met": met})

    a10, l10 = rows.get("async 10 Mbit/s"), rows.get("lock-step 10 Mbit/s")
    if a10 and l10:
        add("10 Mbit/s: every async learner's goodput >= 85%, lock-step's lower",
            f"async min {a10['goodput_min']:.1%} (mean {a10['goodput_mean']:.1%}), lock-step mean "
            f"{l10['goodput_mean']:.1%}",
            a10["goodput_min"] >= 0.85 and l10["goodput_mean"] < a10["goodput_min"])
    st, ls = rows.get("straggler 10 Mbit/s"), rows.get("lock-step straggler 10 Mbit/s")
    for r in (a10, st):
        if r:
            by = {int(n): c for n, c in r["merges_by_contributors"].items()}
            several = sum(c for n, c in by.items() if n >= 2)
            add(f"{r['name']}: at most 10% of contributions refused, most merges with >= 2 contributors",
                f"{r['refused_share']:.1%} refused; {several} of {sum(by.values())} merges with >= 2",
                r["refused_share"] <= 0.10 and 2 * several > sum(by.values()))
    if st and ls:
        ratio = st["system_tokens_per_s"] / ls["system_tokens_per_s"]
        add("straggler (one learner 2x slower), 10 Mbit/s: async system throughput >= 1.3x lock-step's",
            f"{st['system_tokens_per_s']:,.0f} vs {ls['system_tokens_per_s']:,.0f} tokens/s, all tokens over the "
            f"time to the last learner's last step ({ratio:.2f}x)", ratio >= 1.3)
    if st and a10:
        ratio = st["tokens_per_s_mean"] / a10["tokens_per_s_mean"]
        add("straggler: the others' tokens/s >= 90% of the no-straggler run's",
            f"{st['tokens_per_s_mean']:,.0f} vs {a10['tokens_per_s_mean']:,.0f} tokens/s per learner ({ratio:.1%})",
            ratio >= 0.9)
    for rate in ("10 Mbit/s", "100 Mbit/s", "unshaped"):
        a, lk = rows.get(f"async {rate}"), rows.get(f"lock-step {rate}")
        if a and lk:
            rel = a["val_loss"] / lk["val_loss"] - 1
            add(f"{rate}: global validation loss within 2% of lock-step's (same tokens; lower is within)",
                f"{a['val_loss']:.4f} vs {lk['val_loss']:.4f} ({rel:+.1%})", rel <= 0.02)
    f = rows.get("fault 10 Mbit/s")
    if f and a10:
        rel = f["val_loss"] / a10["val_loss"] - 1
        add("fault run: final loss within 3% of the no-fault run's (lower is within)",
            f"{f['val_loss']:.4f} vs {a10['val_loss']:.4f} ({rel:+.1%})", rel <= 0.03)
    shaped = [r for r in rows.values() if "kernel_ratio" in r]
    if shaped:
        worst = max(shaped, key=lambda r: abs(r["kernel_ratio"] - 1))
        add("kernel bytes within 10% of carried + framing (every shaped row)",
            f"ratios {min(r['kernel_ratio'] for r in shaped):.3f} to {max(r['kernel_ratio'] for r in shaped):.3f} "
            f"(worst: {worst['name']})", all(abs(r["kernel_ratio"] - 1) <= 0.10 for r in shaped))
    return t


def build_report(raw: list[dict], argv: list[str], wall_s: float, prov: dict, settings: dict) -> dict:
    """Every row's measurements and summary, and the targets."""
    rows = {r["name"]: summarize(r) for r in raw}
    return {"command": f"{PROG} {shlex.join(argv)}".strip(), "argv": list(argv), "wall_s": wall_s,
            "settings": settings, "mtu": MTU, "segment_header": SEGMENT_HEADER, "provenance": prov,
            "num_params": raw[0]["syncer"]["num_params"] if raw else None,
            "targets": targets(rows), "rows": list(rows.values()), "raw": raw}


def _mb(b) -> str:
    return "" if b is None else f"{b / 1e6:,.2f}"


def to_markdown(report: dict) -> str:
    """The targets, then one line per row."""
    s = report["settings"]
    lines = [(f"Decoupled DiLoCo vs lock-step Streaming DiLoCo: {s['learners']} learner processes and a syncer, "
             f"character transformer ({report['num_params']:,} parameters), {s['steps']} inner steps per learner "
             f"of {s['batch']} x {s['seq_len']} characters, H = {s['sync_every']}, {s['fragments']} fragments, "
             f"{s['compressor']} outer gradients, the asynchronous rows' replies "
             f"{s.get('reply_compressor', 'none')} (lock-step: whole float32 values). Command: `{report['command']}` ({report['wall_s']:.0f} s; load "
             f"average {report['provenance']['loadavg_start'][0]:.1f} at the start, "
             f"{report['provenance']['loadavg_end'][0]:.1f} at the end)."), "",
             "| target | measured | met |", "|---|---|---|"]
    for t in report["targets"]:
        lines.append(f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'no'} |")
    lines += ["", ("| row | system tokens/s (all tokens / time to the last learner's last step) | inner step ms: "
                   "compute / paced (steps over the pace) | refused (share, why) | merges by contributors | "
                   "wait s: link / straggler |"),
              "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if "system_tokens_per_s" not in r:
            continue
        why = ", ".join(f"{k} {v}" for k, v in r["refused_why"].items()) or "-"
        by = ", ".join(f"{k}: {v}" for k, v in r["merges_by_contributors"].items()) or "-"
        paced = (f" / {r['paced_ms_mean']:.1f} ({r['overrun_share']:.1%})" if "paced_ms_mean" in r
                 and r["paced_ms_mean"] > r["step_ms_mean"] else "")
        lines.append(f"| {r['name']} | {r['system_tokens_per_s']:,.0f} | {r['step_ms_mean']:.1f}{paced} | "
                     f"{r['refused_share']:.0%} ({why}) | {by} | {r['link_wait_s']:.1f} / {r['straggler_wait_s']:.1f} |")
    lines += ["", ("| row | goodput (min / mean) | with drain (min) | drain s | tokens/s per learner | tokens | global val loss | merges | "
              "refused | lost while running | counted MB | replies | replies MB (counted as updates) | carried MB | kernel MB | "
              "kernel / (carried + framing) | wall s |"),
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        ratio = f"{r['kernel_ratio']:.3f}" if "kernel_ratio" in r else ""
        lines.append(
            f"| {r['name']} | {r['goodput_min']:.1%} / {r['goodput_mean']:.1%} | {r['goodput_with_drain_min']:.1%} | "
            f"{r['drain_s_mean']:.1f} | {r['tokens_per_s_mean']:,.0f} | "
            f"{r['tokens']:,} | {r['val_loss']:.4f} | {r['merges']} | {r['refused']} | "
            f"{', '.join(r.get('lost_running', r['lost'])) or '-'} | "
            f"{_mb(r['counted_bytes'])} | {r.get('reply_compressor', 'none')} | {_mb(r.get('replies_carried'))} "
            f"({_mb(r.get('replies_counted', 0))}) | "
            f"{_mb(r['carried_bytes'])} | {_mb(r.get('kernel_bytes'))} | {ratio} | "
            f"{r['duration_s']:.0f} |")
    lines += ["", ("Goodput: the fraction of a learner's wall time from its first to its last inner step spent inside them "
              "(with drain: counting the final wait for the replies in flight too; the straggler row: the other "
              "learners; the fault row: the learners that ran to the end, the joiner left out). Counted: the "
              "compressor's message bytes of every contribution (`compjax.decoupled.message_bytes`). Replies: the "
              "syncer's reply codec (none: whole float32 values; e3m0 / bfloat16: each merge's update so encoded "
              "for the contributors at staleness 0, whole values otherwise), the bytes of every reply carried and, "
              "in brackets, those counted by the reply codec for the updates (`Syncer.reply_bytes`). Carried: the "
              "arrays the transport moved (contributions pulled, replies and welcomes, offers handed back). Kernel: "
              "`tc`'s count over the training less an idle baseline; framing = 66 header bytes per packet counted.")]
    for r in report["raw"]:
        ev = r["events"]
        if "killed" in ev:
            lines.append(f"- {r['name']}: {ev['killed']['learner']} killed (SIGKILL) after its step "
                         f"{ev['killed']['step']}, {ev['killed']['t']:.0f} s in"
                         + (f"; its replacement {ev['joined']['learner']} (started then) compiled and joined "
                            f"{ev['joined']['t']:.0f} s in, when the others had taken {ev['joined']['others_step']} "
                            "steps" if "joined" in ev else "")
                         + (f", and stopped after its step {ev['stopped']['step']} when the others were done"
                            if "stopped" in ev else ""))
        if "syncer_stopped" in ev:
            lines.append(f"- {r['name']}: the syncer stopped (SIGTERM) {ev['syncer_stopped']['t']:.0f} s in, when the "
                         f"others had taken {ev['syncer_stopped']['others_step']} steps, and restarted with --resume "
                         f"{ev['syncer_restarted']['t']:.0f} s in")
        if "stopped" in ev and r["mode"] == "straggler":
            lines.append(f"- {r['name']}: the straggler {ev['stopped']['learner']} stopped after its step "
                         f"{ev['stopped']['step']}, when the others were done ({ev['stopped']['t']:.0f} s in)")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Goodput per row (each learner a dot) and the global model's validation loss over wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["name"] for r in report["rows"]]
    ax1.barh(names, [r["goodput_mean"] for r in report["rows"]], color="#9ecae1")
    for y, r in enumerate(report["rows"]):
        ax1.plot(list(r["goodput"].values()), [y] * len(r["goodput"]), "k.")
    ax1.axvline(0.85, color="gray", ls="--", lw=1)
    ax1.set_xlim(0, 1)
    ax1.set_xlabel("goodput (fraction of wall time in inner steps)")
    ax1.invert_yaxis()
    for r in report["raw"]:
        curve = r["syncer"]["val_curve"]
        ax2.plot([max(0.0, c["t"] - r["t_go"]) for c in curve], [c["val_loss"] for c in curve], ".-", label=r["name"])
    ax2.set_xlabel("seconds since the learners started")
    ax2.set_ylabel("global model's validation loss")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report: dict, out_dir: Path) -> None:
    """``async_diloco.json``, ``.md`` and ``.png`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{NAME}.json").write_text(json.dumps(report, indent=1, default=float) + "\n")
    (out_dir / f"{NAME}.md").write_text(to_markdown(report))
    plot(report, out_dir / f"{NAME}.png")
    print(to_markdown(report))
    print(f"wrote {out_dir / NAME}.json, .md, .png")


# ----------------------------------------------------------------------------------------------------------------
# The driver.


def inside(args) -> int:
    """In the namespace (or, ``--quick``, on the host): run the rows; the raw results to ``--result``."""
    settings = {**(QUICK if args.quick else FULL), "outer": args.outer}
    rows = QUICK_ROWS if args.quick else {k: ROWS[k] for k in args.rows}
    raw = []
    with tempfile.TemporaryDirectory(prefix="async-diloco-") as tmp:
        work = Path(args.log_dir or tmp)
        for name, (rate, mode) in rows.items():
            print(f"{name} ...", flush=True)
            t = time.time()
            raw.append(run_row(name, rate, mode, settings, args, work))
            print(f"{name}: {time.time() - t:.0f} s", flush=True)
    Path(args.result).write_text(json.dumps(raw, default=float))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), help="rows to run (default: all)")
    ap.add_argument("--quick", action="store_true", help="2 learners, 60 steps, lock-step and async, no shaping")
    ap.add_argument("--text", type=Path, default=None, help="train on this text file (default: Tiny Shakespeare)")
    ap.add_argument("--idle-s", type=float, default=3.0, help="seconds of the idle baseline per row")
    ap.add_argument("--row-timeout-s", type=float, default=900.0, help="the longest a row may take")
    ap.add_argument("--fault-parts", choices=("learner,syncer", "learner", "syncer"), default="learner,syncer",
                    help="the faults the fault row plants (a diagnostic: the published row plants both): the learner "
                         "killed and the joiner, the syncer stopped and restarted, or both")
    ap.add_argument("--outer", choices=("nesterov", "delayed"), default="nesterov",
                    help="the syncer's outer optimizer in every row (lock-step rows, whose rounds are all full, take "
                         "the same Nesterov steps either way): Nesterov SGD, or delayed_nesterov")
    ap.add_argument("--wait-load", type=float, default=None, metavar="L",
                    help="first wait (at most --wait-max-s) until the 1-minute load average is below L")
    ap.add_argument("--wait-max-s", type=float, default=1200.0)
    ap.add_argument("--publish", action="store_true", help="write to experiments/results/benchmarks")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--log-dir", type=Path, default=None, help="keep every process's log and JSON here")
    ap.add_argument("--report-only", action="store_true", help="rebuild the tables and plot from the output's JSON")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shape", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inside:
        return inside(args)
    out_dir = args.out_dir or (PUBLISHED if args.publish else RUNS)
    argv = sys.argv[1:] if argv is None else list(argv)
    settings = {**(QUICK if args.quick else FULL), "outer": args.outer}
    if args.report_only:
        old = json.loads((out_dir / f"{NAME}.json").read_text())
        write(build_report(old["raw"], old["argv"], old["wall_s"], old["provenance"], old["settings"]), out_dir)
        return 0
    if not args.quick:
        why = permitted()
        if why is not None:
            print(f"async_diloco benchmark skipped: {why} (needs root or CAP_SYS_ADMIN + CAP_NET_ADMIN for "
                  "unshare -n and tc)")
            return 0
    waited, load = (0.0, list(os.getloadavg())) if args.wait_load is None else \
        wait_for_load(args.wait_load, args.wait_max_s)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="async-diloco-") as tmp:
        result = Path(tmp) / "raw.json"
        cmd = [sys.executable, "-m", "experiments.benchmarks.async_diloco", "--inside", "--result", str(result),
               "--idle-s", str(args.idle_s), "--row-timeout-s", str(args.row_timeout_s),
               "--fault-parts", args.fault_parts, "--outer", args.outer]
        cmd += ["--quick"] if args.quick else ["--shape", "--rows", *args.rows]
        if args.text:
            cmd += ["--text", str(args.text.resolve())]
        if args.log_dir:
            cmd += ["--log-dir", str(args.log_dir.resolve())]
        if not args.quick:
            cmd = ["unshare", "-n", "sh", "-c",
                   f"ip link set lo up && ip link set lo mtu {MTU} && exec {shlex.join(cmd)}"]
        r = subprocess.run(cmd, cwd=REPO, check=False)
        if r.returncode != 0 or not result.exists():
            print(f"the rows failed (exit {r.returncode})", file=sys.stderr)
            return 1
        raw = json.loads(result.read_text())
    write(build_report(raw, argv, time.time() - t0, provenance(load, waited, args.wait_load), settings), out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
