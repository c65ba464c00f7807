"""The decoupled syncer: token-weighted merges against NumPy, quorum and grace window, the staleness rule,
refusals that leave the model untouched, and checkpoints that restore bit-identically."""

from __future__ import annotations

import itertools
import logging
import math

import jax
import numpy as np
import optax
import pytest

from compjax.decoupled import Contribution, Header, Incoming, Syncer

SHAPES = {"a": (3, 2), "b": (4,), "c": (2, 2)}
NAMES = ["x", "y", "z"]
_SEQ = itertools.count(1)  # every contribution built here is a new one: its sequence number is above all before


def init():
    rng = np.random.default_rng(0)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


def message(syncer, name, p, base, tokens, seed, **changes):
    """A well-formed contribution to fragment ``p`` (random values), with header fields replaced by ``changes``.

    The syncer's default compressor is cj.identity: the payload is one float32 buffer, the fragment's
    leaves raveled and concatenated (:func:`leaves` splits it back)."""
    rng = np.random.default_rng(seed)
    values = (np.concatenate([rng.normal(size=x.shape).astype(np.float32).ravel()
                              for x in syncer.fragment_values(p)]),)
    fields = {"learner": name, "fragment": p, "base_version": base, "tokens": tokens, "step": 1,
                  "shapes": tuple(v.shape for v in values), "dtypes": tuple(v.dtype.str for v in values), "payload_bytes": 0,
              "seq": next(_SEQ)}
    fields.update(changes)
    return Contribution(Header(**fields), values)


def leaves(syncer, m, p=0):
    """The outer gradient of an identity payload: its buffer split into fragment ``p``'s leaves."""
    shapes = [x.shape for x in syncer.fragment_values(p)]
    cuts = np.cumsum([math.prod(sh) for sh in shapes])[:-1]
    return [part.reshape(sh) for part, sh in zip(np.split(m.values[0], cuts), shapes)]


def snapshot(syncer):
    """Every array of the syncer's state as bytes (dtype and shape included): bitwise comparison."""
    return [(np.asarray(x).dtype.str, np.asarray(x).shape, np.asarray(x).tobytes())
            for x in jax.tree.leaves(syncer.state())]


def np_nesterov(x, g, trace, lr=0.7, mu=0.9):
    """optax.sgd(lr, momentum=mu, nesterov=True) in float64: new x and trace."""
    trace = g + mu * trace
    return x - lr * (g + mu * trace), trace


# --- merges ---------------------------------------------------------------------------------------------


def test_token_weighted_merges_match_numpy():
    """Two merges of one fragment, tokens 1, 2, 5 then 3, 3, 1: weighted means, DiLoCo's Nesterov outer step."""
    s = Syncer(init(), learners=NAMES)
    x = [v.astype(np.float64) for v in s.fragment_values(0)]
    trace = [np.zeros_like(v) for v in x]
    for rnd, tokens in enumerate(([1, 2, 5], [3, 3, 1])):
        msgs = [message(s, n, 0, rnd, t, seed=10 * rnd + i) for i, (n, t) in enumerate(zip(NAMES, tokens))]
        replies = []
        for m in msgs:
            replies += s.submit(m)
        assert [r.learner for r in replies] == NAMES and all(r.accepted for r in replies)
        for j in range(len(x)):
            mean = sum(t * leaves(s, m)[j].astype(np.float64) for t, m in zip(tokens, msgs)) / sum(tokens)
            x[j], trace[j] = np_nesterov(x[j], mean, trace[j])
        for r in replies:
            for a, b in zip(r.values, x):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert s.versions() == [2]
    assert s.last_merged() == {n: [2] for n in NAMES}
    got = jax.tree.leaves(s.global_params())
    for a, b in zip(got, x):  # one fragment holds every leaf, in tree order
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_the_merge_does_not_depend_on_the_order_of_arrival():
    """The same contributions, delivered in two orders over three rounds: bit-identical global model and outer state."""
    names = ["w", *NAMES]
    runs = []
    for order in (names, names[::-1]):
        s = Syncer(init(), learners=names)
        for rnd in range(3):
            msgs = {n: message(s, n, 0, rnd, (1.0, 3.0, 7.0, 0.1)[i], seed=10 * rnd + i) for i, n in enumerate(names)}
            for n in order:
                s.submit(msgs[n])
        assert s.merges[-1] == (0, 3, tuple(order))  # the record keeps the order of arrival
        runs.append(snapshot(s))
    assert runs[0] == runs[1]


def test_quorum_merges_without_the_missing_learner_and_fragments_are_independent():
    s = Syncer(init(), learners=NAMES, fragments=3, min_quorum=2, outer=optax.sgd(1.0))
    assert s.submit(message(s, "x", 1, 0, 1.0, seed=1)) == []
    assert s.submit(message(s, "x", 2, 0, 1.0, seed=2)) == []  # another fragment: its own round
    replies = s.submit(message(s, "y", 1, 0, 3.0, seed=3))
    assert [r.learner for r in replies] == ["x", "y"] and s.versions() == [0, 1, 0]
    assert s.merges == [(1, 1, ("x", "y"))] and s.last_merged()["z"] == [-1, -1, -1]


def test_grace_window_merges_what_came():
    """min_quorum = all: a round with one contribution waits; at the end of its grace window it merges alone."""
    s = Syncer(init(), learners=NAMES, grace_s=10.0, outer=optax.sgd(1.0))
    m = message(s, "x", 0, 0, 2.0, seed=1)
    before = s.fragment_values(0)
    assert s.submit(m, now=100.0) == [] and s.next_deadline() == 110.0
    assert s.tick(now=109.9) == [] and s.versions() == [0]
    replies = s.tick(now=110.0)
    assert [r.learner for r in replies] == ["x"] and s.versions() == [1] and s.next_deadline() is None
    for g, b, v in zip(s.fragment_values(0), before, leaves(s, m)):  # sgd(1): θ - Δ̄, one contributor
        np.testing.assert_allclose(g, b - v, rtol=1e-6, atol=1e-6)


def test_a_stale_contribution_alone_in_its_round_moves_the_model_by_its_discounted_share():
    """Quorum 1, decay α: a contribution one merge old merged alone moves the global values by e^{-α} of its
    outer gradient (a mean over the discounted weights would cancel the discount)."""
    alpha = 0.5
    s = Syncer(init(), learners=NAMES, min_quorum=1, max_staleness=1, staleness_decay=alpha, outer=optax.sgd(1.0))
    s.submit(message(s, "x", 0, 0, 1.0, seed=1))  # merge 1
    stale = message(s, "y", 0, 0, 3.0, seed=2)  # from version 0: staleness 1
    before = [v.astype(np.float64) for v in s.fragment_values(0)]
    s.submit(stale)  # merge 2, alone
    for g, b, v in zip(s.fragment_values(0), before, leaves(s, stale)):
        np.testing.assert_allclose(g, b - math.exp(-alpha) * v, rtol=1e-6, atol=1e-6)


def test_partial_rounds_share_moves_the_model_by_the_rounds_share_of_the_learners_tokens():
    """partial_rounds='share', sgd(1): a round of 2 of 3 learners moves the global values by its share of the
    learners' declared tokens; a learner that left still counts (the tail of a finite run), a lost one does not."""
    s = Syncer(init(), learners=NAMES, min_quorum=2, partial_rounds="share", outer=optax.sgd(1.0), max_tokens=8.0,
               heartbeat_timeout_s=1.0)
    s.register("x", max_tokens=2.0), s.register("y", max_tokens=4.0), s.register("z", max_tokens=2.0)
    mx, my = message(s, "x", 0, 0, 2.0, seed=1), message(s, "y", 0, 0, 4.0, seed=2)
    before = [v.astype(np.float64) for v in s.fragment_values(0)]
    s.submit(mx), s.submit(my)  # merge 1: 6 of the live learners' 8 tokens
    for g, b, vx, vy in zip(s.fragment_values(0), before, leaves(s, mx), leaves(s, my)):
        np.testing.assert_allclose(g, b - (2.0 * vx + 4.0 * vy) / 8.0, rtol=1e-6, atol=1e-6)
    s.leave("y")  # left cleanly: still counted (the tail of a finite run)
    s.heartbeat("x", now=100.0), s.heartbeat("z", now=0.0), s.tick(now=100.0)  # z silent: lost, not counted
    assert s.live() == ("x",)
    mx = message(s, "x", 0, 1, 2.0, seed=3)
    before = [v.astype(np.float64) for v in s.fragment_values(0)]
    s.submit(mx, now=100.0)  # alone (the quorum is 1 now): 2 of the 2 + 4 tokens of x and y
    for g, b, vx in zip(s.fragment_values(0), before, leaves(s, mx)):
        np.testing.assert_allclose(g, b - 2.0 * vx / 6.0, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="partial_rounds"):
        Syncer(init(), learners=NAMES, partial_rounds="half")


def test_without_grace_window_a_round_waits_for_its_quorum():
    s = Syncer(init(), learners=NAMES)
    s.submit(message(s, "x", 0, 0, 2.0, seed=1), now=0.0)
    assert s.tick(now=1e9) == [] and s.versions() == [0] and s.next_deadline() is None


def test_staleness_rule_discounts_then_refuses():
    """max_staleness 1, decay α: a contribution one merge old weighs tokens · e^{-α} over the undiscounted tokens
    (the discount shrinks the update, CGAD); two merges old is refused."""
    alpha = 0.7
    s = Syncer(init(), learners=NAMES, min_quorum=2, max_staleness=1, staleness_decay=alpha, outer=optax.sgd(1.0))
    s.submit(message(s, "x", 0, 0, 1.0, seed=1))
    s.submit(message(s, "y", 0, 0, 1.0, seed=2))  # merge 1
    stale = message(s, "z", 0, 0, 4.0, seed=3)   # taken from version 0: staleness 1
    fresh = message(s, "x", 0, 1, 2.0, seed=4)
    before = [v.astype(np.float64) for v in s.fragment_values(0)]
    assert s.submit(stale) == []
    replies = s.submit(fresh)  # merge 2
    w = np.array([4.0 * math.exp(-alpha), 2.0])
    for g, b, vs, vf in zip(s.fragment_values(0), before, leaves(s, stale), leaves(s, fresh)):
        np.testing.assert_allclose(g, b - (w[0] * vs + w[1] * vf) / (4.0 + 2.0), rtol=1e-6, atol=1e-6)
    assert {r.learner for r in replies} == {"x", "z"}
    old = snapshot(s)
    (reply,) = s.submit(message(s, "y", 0, 0, 1.0, seed=5))  # staleness 2 > 1
    assert not reply.accepted and reply.reason.startswith("stale") and reply.version == 2
    for a, b in zip(reply.values, s.fragment_values(0)):  # the refusal carries the current global values
        np.testing.assert_array_equal(a, b)
    assert snapshot(s) == old


# --- refusals -------------------------------------------------------------------------------------------


def bad_cases():
    """name -> (how to build the bad contribution from a syncer, a word of the logged reason, header refused)."""
    f64 = lambda v: tuple(x.astype(np.float64) for x in v)
    return {
        "unknown learner": (lambda s: message(s, "intruder", 0, 1, 1.0, 1), "unknown learner", True),
        "fragment out of range": (lambda s: message(s, "x", 0, 1, 1.0, 1, fragment=2), "wrong fragment", True),
        "fragment negative": (lambda s: message(s, "x", 0, 1, 1.0, 1, fragment=-1), "wrong fragment", True),
        "fragment not an int": (lambda s: message(s, "x", 0, 1, 1.0, 1, fragment="0"), "wrong fragment", True),
        "too few arrays": (lambda s: edit(s, lambda sh, dt: (sh[:0], dt[:0])), "wrong size", True),
        "too many arrays": (lambda s: edit(s, lambda sh, dt: (sh + sh, dt + dt)), "wrong size", True),
        "declared too large": (lambda s: edit(s, lambda sh, dt: (((1 << 40,),) + sh[1:], dt)), "wrong size", True),
        "declared shape": (lambda s: edit(s, lambda sh, dt: ((sh[0] + (1,),) + sh[1:], dt)), "wrong shape", True),
        "declared smaller": (lambda s: edit(s, lambda sh, dt: (((sh[0][0] - 1,),) + sh[1:], dt)), "wrong shape", True),
        "negative dimension": (lambda s: edit(s, lambda sh, dt: (((-6,),) + sh[1:], dt)), "wrong shape", True),
        "declared dtype": (lambda s: edit(s, lambda sh, dt: (sh, ("<f2",) + dt[1:])), "wrong shape or dtype", True),
        "tokens zero": (lambda s: message(s, "x", 0, 1, 0.0, 1), "tokens", True),
        "tokens nan": (lambda s: message(s, "x", 0, 1, float("nan"), 1), "tokens", True),
        "base version not an integer": (lambda s: message(s, "x", 0, "1", 1.0, 1), "malformed header", True),
        "shapes not a sequence": (lambda s: message(s, "x", 0, 1, 1.0, 1, shapes=7), "malformed header", True),
        "future version": (lambda s: message(s, "x", 0, 5, 1.0, 1), "does not exist", True),
        "negative base version": (lambda s: message(s, "x", 0, -1, 1.0, 1), "does not exist", True),
        "stale": (lambda s: message(s, "x", 0, 0, 1.0, 1), "stale", True),
        "arrays' dtype differs from the header": (
            lambda s: Contribution(message(s, "x", 0, 1, 1.0, 1).header, f64(message(s, "x", 0, 1, 1.0, 1).values)),
            "wrong shape or dtype", False),
        "arrays' shape differs from the header": (
            lambda s: Contribution(message(s, "x", 0, 1, 1.0, 1).header,
                                   tuple(v.reshape(1, -1) for v in message(s, "x", 0, 1, 1.0, 1).values)),
            "wrong shape or dtype", False),
        "nan": (lambda s: poison(message(s, "x", 0, 1, 1.0, 1), np.nan), "non-finite", False),
        "inf": (lambda s: poison(message(s, "x", 0, 1, 1.0, 1), -np.inf), "non-finite", False),
    }


def edit(s, change):
    """x's contribution to fragment 0 with its declared shapes and dtypes changed (the arrays kept)."""
    m = message(s, "x", 0, 1, 1.0, 1)
    shapes, dtypes = change(m.header.shapes, m.header.dtypes)
    return message(s, "x", 0, 1, 1.0, 1, shapes=shapes, dtypes=dtypes)


def poison(m, value):
    values = [v.copy() for v in m.values]
    values[-1].flat[1] = value
    return Contribution(m.header, tuple(values))


@pytest.mark.parametrize("case", sorted(bad_cases()))
def test_bad_contribution_is_refused_logged_and_changes_nothing(case, caplog):
    build, reason, header_refused = bad_cases()[case]
    s = Syncer(init(), learners=NAMES, fragments=2, min_quorum=2)
    s.submit(message(s, "x", 0, 0, 1.0, seed=1))
    s.submit(message(s, "y", 0, 0, 1.0, seed=2))  # one merge: the outer momentum is non-zero
    s.submit(message(s, "z", 0, 1, 1.0, seed=3))  # an open round of one
    old, merges = snapshot(s), list(s.merges)
    bad = build(s)
    pulls = []
    with caplog.at_level(logging.WARNING, logger="compjax.decoupled"):
        replies = s.handle(Incoming(bad.header, lambda: pulls.append(1) or bad.values))
    assert len(s.refused) == 1 and reason in s.refused[0][2]
    assert any(reason in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert pulls == ([] if header_refused else [1])  # a refused header: the arrays are never received
    assert snapshot(s) == old and s.merges == merges
    assert all(not r.accepted for r in replies) and len(replies) == (0 if case == "unknown learner" else 1)
    # The open round is as it was: one good contribution more completes it, with z's and that one only.
    replies = s.submit(message(s, "y", 0, 1, 1.0, seed=4))
    assert [r.learner for r in replies] == ["z", "y"]


def test_a_failed_receive_is_a_refusal():
    s = Syncer(init(), learners=NAMES)
    old = snapshot(s)

    def pull():
        raise ConnectionError("peer went away")

    (reply,) = s.handle(Incoming(message(s, "x", 0, 0, 1.0, seed=1).header, pull))
    assert "peer went away" in reply.reason and snapshot(s) == old and s.versions() == [0]


def test_a_negative_base_version_is_refused_even_when_the_staleness_bound_would_cover_it():
    """max_staleness 3 at version 0: base version -1 would read as staleness 1; it names no version, so it is refused."""
    s = Syncer(init(), learners=NAMES, min_quorum=1, max_staleness=3)
    old = snapshot(s)
    (reply,) = s.submit(message(s, "x", 0, -1, 1.0, seed=1))
    assert not reply.accepted and "does not exist" in reply.reason
    assert snapshot(s) == old and s.versions() == [0] and not s.merges


@pytest.mark.parametrize("merged_first", [True, False], ids=["after its merge", "in its open round"])
def test_a_replayed_contribution_is_refused_at_max_staleness_3_and_nothing_merged(merged_first, caplog):
    """The same contribution submitted again (same header, same sequence number) is refused as a replay, whether
    its first copy was merged (staleness 1 <= 3 would admit it) or still waits in its round; so is an older one."""
    s = Syncer(init(), learners=NAMES, min_quorum=1 if merged_first else 2, max_staleness=3)
    first = message(s, "x", 0, 0, 1.0, seed=1)
    older = message(s, "x", 0, 0, 1.0, seed=2, seq=first.header.seq - 1)
    s.submit(first)
    assert s.versions() == ([1] if merged_first else [0]) and s.last_seqs()["x"] == [first.header.seq]
    old, merges = snapshot(s), list(s.merges)
    with caplog.at_level(logging.WARNING, logger="compjax.decoupled"):
        replies = s.submit(first) + s.submit(older)
    assert [r.accepted for r in replies] == [False, False] and all("replayed" in r.reason for r in replies)
    assert [why[:8] for _, _, why in s.refused] == ["replayed"] * 2 and caplog.text.count("replayed") == 2
    assert snapshot(s) == old and s.merges == merges
    # The next number is taken; the round (if open) completes with x's first copy only.
    s.submit(message(s, "y", 0, 0, 1.0, seed=3))
    assert s.merges[-1][2] == (("y",) if merged_first else ("x", "y"))


def test_a_learner_that_registers_again_numbers_its_contributions_after_the_last_taken():
    s = Syncer(init(), learners=NAMES, min_quorum=1)
    s.submit(message(s, "x", 0, 0, 1.0, seed=1, seq=7))
    assert s.register("x").seqs == (7,) and s.register("w").seqs == (0,) and s.start().seqs == ()
    (reply,) = s.submit(message(s, "x", 0, 1, 1.0, seed=2, seq=8))
    assert reply.accepted and s.last_seqs()["x"] == [7 + 1]


def test_a_second_contribution_to_one_round_is_refused():
    s = Syncer(init(), learners=NAMES)
    s.submit(message(s, "x", 0, 0, 1.0, seed=1))
    old = snapshot(s)
    (reply,) = s.submit(message(s, "x", 0, 0, 1.0, seed=2))
    assert "already contributed" in reply.reason and snapshot(s) == old


# --- arguments and checkpoints ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, word", [
    ({"learners": []}, "learners"), ({"learners": ["a", "a"]}, "learners"),
    ({"learners": NAMES, "min_quorum": 4}, "min_quorum"), ({"learners": NAMES, "min_quorum": 0}, "min_quorum"),
    ({"learners": NAMES, "grace_s": 0.0}, "grace_s"), ({"learners": NAMES, "max_staleness": -1}, "max_staleness"),
    ({"learners": NAMES, "staleness_decay": -0.1}, "staleness_decay"), ({"learners": NAMES, "fragments": 4}, "fragments"),
    ({"learners": NAMES, "outer": "sgd"}, "outer"),
    ({"learners": NAMES, "grace_s": 5.0, "adaptive_grace": 0.5}, "adaptive_grace"),
    ({"learners": NAMES, "adaptive_grace": 2.0}, "adaptive_grace"),
])
def test_bad_arguments_raise_naming_the_parameter(kwargs, word):
    with pytest.raises(ValueError, match=word):
        Syncer(init(), **kwargs)


def test_checkpoint_round_trip_is_bit_identical(tmp_path):
    def run(s, first, last):
        for v in range(first, last):
            s.submit(message(s, "x", v % 2, v // 2, 1.0 + v, seed=2 * v))
            s.submit(message(s, "y", v % 2, v // 2, 2.0, seed=2 * v + 1))

    s = Syncer(init(), learners=["x", "y", "z"], fragments=2, min_quorum=2)
    run(s, 0, 4)
    s.save(tmp_path / "ckpt", step=4)
    fresh = Syncer(init(), learners=["x", "y", "z"], fragments=2, min_quorum=2)
    assert fresh.restore(tmp_path / "ckpt") == 4
    assert snapshot(fresh) == snapshot(s) and fresh.last_seqs() == s.last_seqs()
    assert fresh.versions() == [2, 2] and fresh.last_merged() == s.last_merged()
    assert fresh.last_merged() == {"x": [2, 2], "y": [2, 2], "z": [-1, -1]}
    run(s, 4, 6)  # the outer momentum came back too: the next merges agree bit for bit
    run(fresh, 4, 6)
    assert snapshot(fresh) == snapshot(s)
    with pytest.raises(ValueError, match="learners"):
        Syncer(init(), learners=["x", "y", "w"], fragments=2).restore(tmp_path / "ckpt")


def test_a_fragment_of_more_than_ten_leaves_and_nesterov_momentum_round_trip_bit_identical(tmp_path):
    """14 same-shaped leaves in one fragment (list indices past 9, which a store keyed by strings would sort
    '0', '1', '10', ...) under DiLoCo's Nesterov outer optimizer: restored bit-identical, the next merges equal."""
    rng = np.random.default_rng(0)
    params = {f"l{i:02d}": rng.normal(size=(4,)).astype(np.float32) for i in range(14)}
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    make = lambda: Syncer({k: v.copy() for k, v in params.items()}, learners=["x", "y"], min_quorum=2, outer=outer)

    def run(s, first, last):
        for v in range(first, last):
            s.submit(message(s, "x", 0, v, 1.0, seed=2 * v))
            s.submit(message(s, "y", 0, v, 1.0, seed=2 * v + 1))

    s = make()
    run(s, 0, 3)
    s.save(tmp_path / "ckpt", step=3)
    fresh = make()
    fresh.restore(tmp_path / "ckpt")
    assert snapshot(fresh) == snapshot(s)
    run(s, 3, 5)
    run(fresh, 3, 5)
    assert snapshot(fresh) == snapshot(s)


# --- bounded influence -------------------------------------------------------------------------------------


def scaled(s, name, base, value, tokens=1.0, p=0):
    """A contribution to fragment ``p`` whose outer gradient is ``value`` everywhere."""
    m = message(s, name, p, base, tokens, seed=0)
    return Contribution(m.header, tuple(np.full(v.shape, value, v.dtype) for v in m.values))


def bounded_syncer(**kwargs):
    """Quorum 1, DiLoCo's outer optimizer, x declared 64 tokens per contribution; two merges of ordinary
    contributions (norms about 3: the fragment's reference) and a non-zero outer momentum."""
    s = Syncer(init(), learners=NAMES, min_quorum=1, max_staleness=3, **kwargs)
    s.register("x", max_tokens=64.0)
    for v in range(2):
        assert s.submit(message(s, "y", 0, v, 8.0, seed=v))[0].accepted
    return s


@pytest.mark.parametrize("case, word", [
    (lambda s: scaled(s, "x", 2, 1e30), "norm"),
    (lambda s: scaled(s, "x", 2, 3e38, tokens=1e30), "above the 64.0 per contribution"),
    (lambda s: message(s, "x", 0, 2, 64.5, seed=5), "above the 64.0 per contribution"),
    (lambda s: message(s, "z", 0, 2, 1e6 + 1, seed=5), "above the 1000000.0 per contribution"),
], ids=["outer gradient 1e30", "3e38 with tokens 1e30", "tokens above the declared cap",
        "tokens above the syncer's max_tokens"])
def test_a_contribution_that_would_dominate_the_merge_is_refused_and_the_model_is_bit_identical(case, word, caplog):
    s = bounded_syncer(max_tokens=1e6)
    old, merges = snapshot(s), list(s.merges)
    with caplog.at_level(logging.WARNING, logger="compjax.decoupled"):
        (reply,) = s.submit(case(s))
    assert not reply.accepted and word in reply.reason and word in caplog.text
    assert snapshot(s) == old and s.merges == merges
    # At the cap, and at 9 times the reference norm, a contribution is merged.
    ref = np.linalg.norm(np.concatenate([np.ravel(v) for v in message(s, "y", 0, 0, 1.0, seed=0).values]))
    assert s.submit(message(s, "x", 0, 2, 64.0, seed=6))[0].accepted
    m = message(s, "z", 0, 3, 1.0, seed=7)
    nine = Contribution(m.header, tuple(v * (9 * ref / np.linalg.norm(v)) for v in m.values))
    assert s.submit(nine)[0].accepted and s.versions() == [4]


@pytest.mark.parametrize("outer, value", [(None, 3e38), (optax.adam(0.1), 1e20)],
                         ids=["values: Nesterov overflows", "state only: Adam's second moment overflows"])
def test_a_merge_whose_result_would_not_be_finite_is_refused_and_the_model_kept(outer, value, caplog):
    """No norm reference yet (the fragment's first merge): a finite outer gradient accepted into its round, whose
    merge is not finite: 3e38 overflows DiLoCo's Nesterov step (the values); 1e20 squared overflows Adam's second
    moment while its step, m / sqrt(inf), leaves the values finite (the state).  The round is refused; the model,
    outer state and version kept."""
    s = Syncer(init(), learners=NAMES, min_quorum=2, outer=outer)
    s.submit(scaled(s, "x", 0, value))
    old = snapshot(s)
    with caplog.at_level(logging.WARNING, logger="compjax.decoupled"):
        replies = s.submit(scaled(s, "y", 0, value))
    assert [(r.learner, r.accepted) for r in replies] == [("x", False), ("y", False)]
    assert all("would not be finite" in r.reason for r in replies) and "would not be finite" in caplog.text
    for r in replies:  # each contributor resumes from the current values
        for a, b in zip(r.values, s.fragment_values(0)):
            np.testing.assert_array_equal(a, b)
    assert snapshot(s) == old and s.versions() == [0] and not s.merges and len(s.refused) == 2
    assert s.submit(message(s, "x", 0, 0, 1.0, seed=1)) == []  # the fragment goes on: a new round opens
    assert [r.accepted for r in s.submit(message(s, "y", 0, 0, 1.0, seed=2))] == [True, True]


def test_token_caps_and_norm_bounds_are_checked():
    s = Syncer(init(), learners=NAMES, max_tokens=100.0)
    for bad in (0.0, -1.0, 101.0, float("nan"), "8"):
        with pytest.raises(ValueError, match="max_tokens"):
            s.register("w", max_tokens=bad)
    with pytest.raises(ValueError, match="max_tokens"):
        Syncer(init(), learners=NAMES).register("w", max_tokens=float("inf"))
    for kwargs in ({"max_tokens": 0.0}, {"norm_bound": 0.5}, {"norm_window": 0}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            Syncer(init(), learners=NAMES, **kwargs)
    off = Syncer(init(), learners=NAMES, min_quorum=1, norm_bound=None)
    off.submit(message(off, "x", 0, 0, 1.0, seed=1))
    assert off.submit(scaled(off, "x", 1, 1e30))[0].accepted  # the norm bound turned off: merged


def test_the_adaptive_grace_window_follows_the_spread_of_recent_arrivals():
    """adaptive_grace c = 2: after rounds whose last contribution came 1.0 s and 1.5 s after the first, a round
    waits min(grace_s, 2 x q90) = 2 x 1.45 = 2.9 s, not grace_s = 10 s; before any round, grace_s."""
    s = Syncer(init(), learners=NAMES, grace_s=10.0, adaptive_grace=2.0, outer=optax.sgd(1.0))
    assert s.grace(0) == 10.0
    for v, (t0, spread) in enumerate([(0.0, 1.0), (20.0, 1.5)]):
        s.submit(message(s, "x", 0, v, 1.0, seed=3 * v), now=t0)
        s.submit(message(s, "y", 0, v, 1.0, seed=3 * v + 1), now=t0 + spread / 2)
        replies = s.submit(message(s, "z", 0, v, 1.0, seed=3 * v + 2), now=t0 + spread)  # the quorum: all three
        assert len(replies) == 3 and s.versions()[0] == v + 1
    want = 2.0 * float(np.percentile([1.0, 1.5], 90))
    assert s.grace(0) == pytest.approx(want)
    with pytest.raises(ValueError, match="fragment"):
        s.grace(1)
    assert s.submit(message(s, "x", 0, 2, 1.0, seed=9), now=100.0) == []
    assert s.next_deadline() == pytest.approx(100.0 + want)
    assert s.tick(now=100.0 + want - 0.01) == [] and s.versions()[0] == 2
    assert [r.learner for r in s.tick(now=100.0 + want)] == ["x"] and s.versions()[0] == 3
