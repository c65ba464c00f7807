"""The uplink: a compjax compressor over the client axis, its admissibility for an algorithm, and each client's own payload.

The mean over participating clients of their compressed messages **is** the
compressor's collective over the client axis (one call of its ``update`` per
round), so the uplink bytes are the compressor's ``payload_bytes``
(:func:`compjax.payload_bytes`) and :func:`compjax.audit_collectives` reads
the same bytes from the compiled round under ``shard_map``.

SCALLION and SCAFCOM also need, on each client, the message **as the server
decoded it** (``c_i ← c_i + C(δ_i)``, so that ``c = mean_i c_i`` stays exact).
The compressor pipeline computes it anyway (it is what error feedback
subtracts): :func:`exchange` asks for it with
:func:`compjax.compressors.base.update_with_sent`, in the same call as the
collective, so no client compresses twice and no byte more is sent.  A keyed
compressor's draws (random-k, QSGD: keyed by step and slot) are those of the
exchange itself.

Compressors whose decoded values depend on other clients' data (TernGrad's
shared scaler, PowerSGD's shared low-rank basis) cannot tell a client what
the server received from it, and compressors with per-parameter memory (an
error-feedback residual, DGC's momenta) would keep it per slot, not per
client: both are refused where they would be wrong.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax.compressors.base import update_with_sent

__all__ = ["BIASED", "EXACT", "UNBIASED", "UplinkInfo", "Uplinked", "check_uplink", "exchange"]

#: State types of compressors that send their input unchanged.
EXACT = frozenset({"IdentityState"})
#: State types of unbiased compressors, ``E[C(x)] = x`` (random-k without error feedback is scaled by ``d/k``).
UNBIASED = frozenset({"RandomkState", "QsgdState"})
#: State types of biased (contractive) compressors whose payload each client can decode alone.
BIASED = frozenset({"TopkState", "CastState", "SignsgdState", "OnebitState", "TwobitState", "E3m0State"})

_PROBE = {"b": jax.ShapeDtypeStruct((5,), jnp.float32), "w": jax.ShapeDtypeStruct((7, 3), jnp.float32)}


class UplinkInfo(NamedTuple):
    """What :func:`check_uplink` found out about a compressor.

    Attributes:
      kind: ``"exact"``, ``"unbiased"``, ``"biased"`` or ``"other"`` (a state type not listed here).
      state_type: the name of its state's type.
    """

    kind: str
    state_type: str


def _kind(name: str) -> str:
    if name in EXACT:
        return "exact"
    if name in UNBIASED:
        return "unbiased"
    if name in BIASED:
        return "biased"
    return "other"


def check_uplink(compressor: Any, client_axis: str, *, algorithm: str, accepts: frozenset,
                 sent: bool = False) -> UplinkInfo:
    """Check at build time that ``compressor`` can carry ``algorithm``'s uplink over ``client_axis``.

    Traces (``jax.eval_shape``; nothing runs) the compressor's ``init`` and
    ``update`` on a small probe tree twice: for two clients under
    ``jax.vmap(..., axis_name=client_axis)``, which must trace, and for one
    client with no axis bound, which must not: a compressor that averages
    over the client axis needs the axis bound, one built with
    ``axis_name=None`` (or any transformation that sends nothing) does not.

    Args:
      compressor: a compjax compressor (``optax.GradientTransformation``).
      client_axis: the axis the clients are mapped over.
      algorithm: the algorithm's name, for the messages.
      accepts: the kinds (:class:`UplinkInfo`) the algorithm accepts.
      sent: the algorithm needs each client's decoded message
        (:func:`exchange` with ``sent=True``): the probe asks for it too.

    Returns:
      :class:`UplinkInfo`.

    Raises:
      ValueError: ``compressor`` is not an optax transformation; it keeps
        per-parameter memory (an error-feedback residual: build it with
        ``error_feedback=False``); it was not built with
        ``axis_name=client_axis``; its kind is not in ``accepts`` (e.g. a
        biased compressor into SCALLION, whose analysis needs ``E[C(x)] = x``);
        or, with ``sent``, it does not report what it sent.
    """
    if not isinstance(compressor, optax.GradientTransformation):
        raise ValueError(f"compressor must be a compjax compressor (an optax GradientTransformation) or None, "  # noqa: TRY004
                         f"got {compressor!r}")
    state = jax.eval_shape(compressor.init, _PROBE)
    name = type(state).__name__
    shapes = {tuple(s.shape) for s in _PROBE.values()}
    memory = [x for x in jax.tree.leaves(state) if tuple(x.shape) in shapes and jnp.issubdtype(x.dtype, jnp.floating)]
    if memory:
        raise ValueError(
            f"{algorithm}: the compressor ({name}) keeps per-parameter memory (an error-feedback residual or "
            "momenta); its state lives in the participation slots, not with the clients, so that memory would "
            "mix clients across rounds. Build it with error_feedback=False (SCAFCOM's control variates play the "
            "part of error feedback)")
    kind = _kind(name)
    with_sent = sent and kind in accepts

    def probe(g, s):
        return update_with_sent(compressor, g, s)[0] if with_sent else compressor.update(g, s)[0]

    two = jax.tree.map(lambda x: jax.ShapeDtypeStruct((2, *x.shape), x.dtype), (_PROBE, state))
    try:
        jax.eval_shape(jax.vmap(probe, axis_name=client_axis), *two)
    except NameError as e:
        raise ValueError(f"{algorithm}: the compressor must be built with axis_name={client_axis!r} (the client "
                         f"axis), but it uses another axis: {e}") from None
    except ValueError as e:  # compjax's own checks: an axis not bound here, no decoded payload to report
        raise ValueError(f"{algorithm}: {e}") from None
    try:
        jax.eval_shape(probe, _PROBE, state)
    except (NameError, ValueError):  # the client axis is unbound here: it is what the compressor averages over
        pass
    else:
        raise ValueError(f"{algorithm}: the compressor issues no collective over the client axis: build it with "
                         f"axis_name={client_axis!r}, not axis_name=None")
    if kind not in accepts:
        why = {
            "unbiased": "it is an unbiased compressor with variance (e.g. random-k scaled by d/k, QSGD); SCAFCOM's "
                        "analysis needs a contractive (biased) one such as top-k; use scallion for unbiased ones",
            "biased": "it is a biased compressor; SCALLION's analysis needs an unbiased one, E[C(x)] = x "
                      "(cj.randomk(..., error_feedback=False) or cj.qsgd(...)); use scafcom for biased ones",
            "other": "its decoded payload is not a function of the client's own message alone (or its kind is "
                     f"unknown), so a client cannot know what the server received from it; accepted kinds: "
                     f"{sorted(accepts)} ({sorted(EXACT | UNBIASED | BIASED)})",
        }[kind]
        raise ValueError(f"{algorithm} cannot use this compressor ({name}): {why}")
    return UplinkInfo(kind, name)


class Uplinked(NamedTuple):
    """What :func:`exchange` returns.

    Attributes:
      mean: the mean over participating clients of ``C(message)``, a pytree like the message.
      comm: the compressor's new state.
      skipped: bool scalar, true when the compressor's non-finite vote skipped
        the exchange (its ``skipped`` counter went up); always false for a
        compressor without that counter.
      sent: this client's message as the server decoded it (a pytree like the
        message), or None when not asked for.
    """

    mean: Any
    comm: Any
    skipped: jnp.ndarray
    sent: Any


def exchange(compressor, message: Any, comm_state: Any, *, sent: bool = False) -> Uplinked:
    """The uplink collective of one client: the mean over clients of ``C(message)``, and with ``sent`` its own ``C(message)``.

    Call it where the client axis is bound (inside ``jax.vmap`` or
    ``jax.shard_map`` over the clients).  One call of the compressor's
    ``update`` either way: with ``sent=True`` through
    :func:`compjax.compressors.base.update_with_sent`, which returns the
    decoded own payload that the pipeline computes beside the collective.

    Args:
      compressor: the uplink compressor (checked by :func:`check_uplink`).
      message: this client's message, a pytree of float arrays.
      comm_state: the compressor's state in this client's participation slot.
      sent: also return this client's decoded message (SCALLION, SCAFCOM).

    Returns:
      :class:`Uplinked`.

    Raises:
      ValueError: ``sent=True`` and the compressor does not report what it
        sent (see :func:`compjax.compressors.base.update_with_sent`).
    """
    if sent:
        mean, new_state, own = update_with_sent(compressor, message, comm_state)
    else:
        (mean, new_state), own = compressor.update(message, comm_state), None
    if hasattr(comm_state, "skipped"):
        skipped = new_state.skipped > comm_state.skipped
    else:
        skipped = jnp.zeros((), jnp.bool_)
    return Uplinked(mean, new_state, skipped, own)
