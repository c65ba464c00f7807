"""Learners and the syncer as separate processes: ZeroMQ control frames, arrays over ``jax.experimental.transfer``.

The syncer binds a ZeroMQ ROUTER socket; each learner connects a DEALER socket whose identity is its
name.  Control messages are small JSON frames:

* ``hello`` (learner -> syncer): join, or rejoin after a syncer restart; answered by ``welcome``
  (the syncer's id, every fragment's version, and a transfer id under which the syncer offers the
  current global values).
* ``heartbeat`` (learner -> syncer, every ``heartbeat_s``), answered by a ``heartbeat`` carrying the
  syncer's id: the syncer counts the learner alive (:meth:`Syncer.heartbeat
  <compjax.decoupled.Syncer.heartbeat>`), the learner notices a restarted syncer (a new id) and says
  ``hello`` again.
* ``header`` (learner -> syncer): a :class:`~compjax.decoupled.Header`, the transfer id of its
  arrays and the learner's transfer address.  The syncer pulls the arrays only after it admitted
  the header, into buffers of the header's (checked) shapes and dtypes; a header it did not pull is
  answered by ``release``, on which the learner drops its offer.
* ``reply`` (syncer -> learner): a :class:`~compjax.decoupled.Reply` without its arrays, plus the
  transfer id under which the syncer offers them (``"update": true`` when they are the compressed
  update rather than the whole values).
* ``resend`` (learner -> syncer): the arrays of its last reply for a fragment arrived corrupted (their CRC-32
  differs from the frame's); the syncer offers them again under a new transfer id, in a new ``reply``.
* ``goodbye`` (learner -> syncer, on :meth:`MultiProcessTransport.close`): a clean leave
  (:meth:`Syncer.leave <compjax.decoupled.Syncer.leave>`).

``hello`` also carries the learner's transfer address (the only one the syncer pulls its
contributions from) and, optionally, the token cap it declares.  With keys (ZeroMQ CURVE, pyzmq's
``zmq.auth``: see :meth:`MultiProcessTransport.for_syncer`) every connection authenticates against
an allow-list, frames are encrypted, and a learner is named by its key; without keys the syncer
binds only a loopback address unless told ``insecure=True``.

Arrays move with ``jax.experimental.transfer``: every process runs a transfer server bound to the
address its peers reach it at (its *advertised* host, see :class:`MultiProcessTransport`), and every
``header``, ``welcome`` and ``reply`` frame carries that server's ``HOST:PORT`` in its ``address``
field; the sender offers arrays with ``await_pull(uuid, arrays)``, the receiver pulls them with
``connect(address).pull(uuid, specs)``.  The arrays of one offer travel as one buffer (their bytes one
after the other) whose CRC-32 rides in the frame: jaxlib 0.10.2's transfer, when several arrays are
pulled at once on a loaded machine, has delivered the first bytes of one array into another of the
same pull (seen between CPU processes), and under load a buffer has still arrived changed now and then.
A buffer that arrives other than it left raises :class:`TransferError` and is never used: a
contribution is refused (its learner is still pulled from), and a learner asks for a reply again with
a ``resend`` frame (at most :data:`RESENDS` times), which the syncer answers by offering that reply's
arrays once more (it keeps each learner's last reply per fragment for that).  A pull from a process
that died fails at once; a receive (the pull and the arrival of its arrays) that takes longer than
``pull_timeout_s`` is abandoned:
the contribution is refused, and the syncer pulls nothing more from that learner until it says
``hello`` again (a learner killed in the middle of a transfer never completes it).  A learner
receives the merged fragments on a background thread, so their transfers overlap its inner steps.

ZeroMQ rather than gRPC: no schema compiler or generated stubs, ROUTER/DEALER sockets that address
peers by name and reconnect by themselves (a restarted syncer on the same address is found again
without any code here).  ``pyzmq`` is an optional dependency: ``pip install 'compjax[decoupled]'``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import math
import queue
import re
import secrets
import socket
import threading
import time
import zlib

import jax
import numpy as np

from compjax._checks import check_range
from compjax.decoupled.messages import Contribution, Header, RESTARTED, Reply, Start
from compjax.decoupled.transport import Incoming, Transport

logger = logging.getLogger("compjax.decoupled")

_SERVERS: dict[str, object] = {}  # this process's transfer servers by bound host, started on first use
_SERVER_LOCK = threading.Lock()
_ENDPOINT = re.compile(r"tcp://(?P<host>[^:/\s]+):(?P<port>[0-9]{1,5})")
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")


def _zmq():
    try:
        import zmq
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("compjax.decoupled.MultiProcessTransport needs pyzmq: "
                          "pip install 'compjax[decoupled]' (or pip install pyzmq)") from e
    return zmq


def transfer_server(host: str | None = None):
    """This process's ``jax.experimental.transfer`` server bound to ``host`` (started on the first call).

    Args:
      host: the IPv4 address the server binds and advertises (its ``address()`` is ``HOST:PORT``,
        a free port): an address of one of this machine's interfaces.  None: the first server
        this process started (one on 127.0.0.1 if none was).

    Raises:
      ValueError: ``host`` is not an address of this machine (the server cannot bind it).
    """
    from jax.experimental import transfer

    with _SERVER_LOCK:
        if host is None:
            if _SERVERS:
                return next(iter(_SERVERS.values()))
            host = "127.0.0.1"
        if host not in _SERVERS:
            client = jax.local_devices()[0].client
            try:
                _SERVERS[host] = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
            except Exception as e:  # jax raises JaxRuntimeError (the bind failed)
                raise ValueError(f"advertise must be an IPv4 address of one of this machine's interfaces "
                                 f"(the transfer server binds it), got {host!r}: {e}") from e
        return _SERVERS[host]


def parse_endpoint(address, *, bind: bool, name: str = "address") -> tuple[str, int]:
    """``(host, port)`` of a ZeroMQ TCP endpoint ``tcp://HOST:PORT``, checked.

    Args:
      address: the endpoint.  HOST is an IPv4 address; to bind (``bind=True``) also ``*`` or
        ``0.0.0.0`` (every interface), and PORT may be 0 (a free one); to connect, HOST may also be
        a host name and PORT is 1..65535.
      bind: whether the endpoint is bound (the syncer) or connected to (a learner).
      name: the parameter's name in the error message.

    Raises:
      ValueError: ``address`` is not such an endpoint (the message names ``name``).
    """
    form = ("tcp://HOST:PORT with HOST an IPv4 address, * or 0.0.0.0 (every interface) and PORT 0..65535"
            if bind else "tcp://HOST:PORT with HOST an IPv4 address or host name and PORT 1..65535")
    m = _ENDPOINT.fullmatch(address) if isinstance(address, str) else None
    if m is None:
        raise ValueError(f"{name} must be a TCP endpoint {form}, got {address!r}")
    host, port = m["host"], int(m["port"])
    ok_host = (host in ("*", "0.0.0.0") if bind else False) or _is_ipv4(host) or (
        not bind and _HOSTNAME.fullmatch(host) is not None and not host.replace(".", "").isdigit())
    if not ok_host or not (0 if bind else 1) <= port <= 65535:
        raise ValueError(f"{name} must be a TCP endpoint {form}, got {address!r}")
    return host, port


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def local_address_towards(host: str, port: int = 9) -> str:
    """The IPv4 address this machine uses to reach ``host``: the source address the kernel picks.

    A UDP socket is connected (no packet is sent) and its local address read; a loopback
    ``host`` gives 127.0.0.1.  A host with no route (or a name that does not resolve) gives 127.0.0.1.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port or 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _check_advertise(advertise) -> str | None:
    if advertise is None:
        return None
    if not (isinstance(advertise, str) and _is_ipv4(advertise)) or ipaddress.IPv4Address(advertise).is_unspecified:
        raise ValueError(f"advertise must be the IPv4 address other machines reach this process at "
                         f"(not 0.0.0.0), or None, got {advertise!r}")
    return advertise


def _is_loopback(host: str) -> bool:
    return _is_ipv4(host) and ipaddress.IPv4Address(host).is_loopback


def _key_pair(path, name: str) -> tuple[bytes, bytes]:
    """The (public, secret) CURVE keys of a ZeroMQ certificate with its secret (``zmq.auth.create_certificates``'s
    ``NAME.key_secret``), Z85-encoded."""
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{name} must be a ZeroMQ certificate file, got {path!r}: {e}") from e
    if secret is None:
        raise ValueError(f"{name} must hold a secret key (zmq.auth.create_certificates's NAME.key_secret), "
                         f"got the public certificate {path!r}")
    return public, secret


def _public_key(path, name: str) -> bytes:
    import zmq.auth

    try:
        return zmq.auth.load_certificate(path)[0]
    except (OSError, ValueError) as e:
        raise ValueError(f"{name} must be a ZeroMQ certificate file, got {path!r}: {e}") from e


def _allow_list(directory) -> dict[bytes, str]:
    """``{public key (Z85): learner name}`` of every ``NAME.key`` certificate in ``directory``."""
    from pathlib import Path

    root = Path(directory) if isinstance(directory, (str, Path)) else None
    if root is None or not root.is_dir():
        raise ValueError(f"allowed_keys must be a directory of the learners' public certificates (NAME.key), "
                         f"got {directory!r}")
    keys = {_public_key(f, "allowed_keys"): f.stem for f in sorted(root.glob("*.key"))}
    if not keys:
        raise ValueError(f"allowed_keys must hold at least one learner certificate NAME.key, {root} has none")
    return keys


def _authenticator(ctx, allowed: dict[bytes, str]):
    """A started ``zmq.auth`` thread that admits the CURVE clients of ``allowed`` and names each by its file."""
    from zmq.auth.thread import ThreadAuthenticator
    from zmq.utils import z85

    class Allowed(ThreadAuthenticator):
        def curve_user_id(self, client_public_key: bytes) -> str:  # the User-Id of the client's frames
            return allowed[z85.encode(client_public_key)]

    auth = Allowed(ctx, log=logging.getLogger("compjax.decoupled.auth"))
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_Provider(allowed))
    return auth


class _Provider:
    """The allow-list for ``zmq.auth``'s CURVE callback: a key is admitted if it is listed."""

    def __init__(self, allowed: dict[bytes, str]):
        self.allowed = dict(allowed)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed


def _specs(shapes, dtypes) -> list:
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return [jax.ShapeDtypeStruct(tuple(int(d) for d in s), np.dtype(t), sharding=sharding)
            for s, t in zip(shapes, dtypes)]


def _bounded(fn, timeout: float, what: str):
    """``fn()`` on a helper thread, waited for at most ``timeout`` seconds (a hung transfer stays behind)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True, name="compjax-transfer")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"{what}: no answer within {timeout} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


#: How many times a learner asks the syncer to offer a reply's arrays again when they arrive corrupted.
RESENDS = 3


class TransferError(ConnectionError):
    """The arrays of a transfer arrived other than they were sent (their CRC-32 differs): they are not used."""


def _pack(arrays) -> np.ndarray:
    """The bytes of ``arrays`` (NumPy or JAX; each in C order) one after the other: one uint8 array."""
    parts = [np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8) for x in arrays]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def _packed_bytes(shapes, dtypes) -> int:
    return sum(math.prod(int(d) for d in s) * np.dtype(t).itemsize for s, t in zip(shapes, dtypes))


def _unpack(buf: np.ndarray, shapes, dtypes) -> tuple:
    """The arrays of ``shapes`` and ``dtypes`` whose bytes :func:`_pack` put one after the other in ``buf``."""
    out, at = [], 0
    for s, t in zip(shapes, dtypes):
        shape, dt = tuple(int(d) for d in s), np.dtype(t)
        n = math.prod(shape) * dt.itemsize
        out.append(buf[at:at + n].view(dt).reshape(shape))
        at += n
    return tuple(out)


def _offer(arrays, server=None) -> tuple[int, int]:
    """Offer ``arrays`` (NumPy or JAX) for one pull on ``server`` (default: this process's first), packed into one
    buffer (:func:`_pack`): the transfer id and the buffer's CRC-32 (``zlib.crc32``), both for the frame."""
    uuid = secrets.randbits(62)
    buf = _pack(arrays)  # a sharded learner's shards are read each from its own device: never gathered there
    (server or transfer_server()).await_pull(uuid, [jax.device_put(buf, jax.local_devices()[0])])
    return uuid, zlib.crc32(buf)


def _transfer(address: str, uuid: int, specs: list) -> list:
    """Start pulling transfer ``uuid`` from ``address``: arrays that are complete once their values arrive."""
    return transfer_server().connect(address).pull(uuid, specs)


def _pull(address: str, uuid: int, shapes, dtypes, timeout: float, what: str, crc: int | None = None) -> tuple:
    """The arrays of transfer ``uuid`` (offered by :func:`_offer`) as NumPy arrays of ``shapes`` and ``dtypes``;
    the whole receive bounded by ``timeout`` seconds.

    ``pull`` returns before the values have arrived: waiting for them (``np.asarray``) is part of
    the bounded receive, so a sender that dies mid-transfer costs at most ``timeout``.  With ``crc`` (the
    sender's, from the frame) the bytes that arrived are checked against it.

    Raises:
      TimeoutError: the arrays did not arrive within ``timeout`` seconds.
      TransferError: the bytes that arrived are not those sent (their CRC-32 differs from ``crc``).
    """
    if not shapes:
        return ()
    specs = _specs([(_packed_bytes(shapes, dtypes),)], ["|u1"])

    def receive():
        buf = np.asarray(_transfer(address, uuid, specs)[0])
        if crc is not None and (got := zlib.crc32(buf)) != int(crc):
            raise TransferError(f"{what}: the arrays arrived corrupted (CRC-32 {got:#010x}, sent {int(crc):#010x}): "
                                f"not used")
        return _unpack(buf, shapes, dtypes)

    return _bounded(receive, timeout, what)


def _header_dict(h: Header) -> dict:
    d = dataclasses.asdict(h)
    d["shapes"] = [list(s) for s in h.shapes]
    d["dtypes"] = list(h.dtypes)
    return d


def _header_from(d: dict) -> Header:
    d = dict(d)
    d["shapes"] = tuple(tuple(s) for s in d["shapes"])
    d["dtypes"] = tuple(d["dtypes"])
    return Header(**d)


@dataclasses.dataclass
class _Record:
    """The syncer side's record of the last received header: whose, its transfer id, whether pulled."""

    identity: bytes
    uuid: int
    pulled: bool = False


class MultiProcessTransport(Transport):
    """Learners and the syncer in separate processes (ZeroMQ control, ``jax.experimental.transfer`` arrays).

    Build one per process with :meth:`for_syncer` (binds the address) or :meth:`for_learner`
    (connects to it); each serves one side of :class:`~compjax.decoupled.Transport` and raises
    ``RuntimeError`` for the other side's methods.  Addresses are ZeroMQ TCP endpoints
    ``tcp://HOST:PORT``: the syncer binds one (HOST an IPv4 address of its machine, or ``*`` /
    ``0.0.0.0`` for every interface; port 0 picks a free one, see :attr:`address`), a learner
    connects to it from the same machine or another.

    Arrays do not travel over that socket: each process runs a ``jax.experimental.transfer``
    server, bound to its *advertised* host (:attr:`advertise`, an IPv4 address of one of its
    interfaces that the peers can reach), and puts that server's ``HOST:PORT`` in the ``address``
    field of every frame that offers arrays; the peer pulls from there.  By default the syncer
    advertises the host it binds (for ``*`` / ``0.0.0.0``: its address on the default route, or
    127.0.0.1 without one) and a learner the local address of its route towards the syncer
    (127.0.0.1 for a syncer on its own machine); pass ``advertise=`` where that is not the address
    the peers reach (several interfaces).  Behind a NAT the peers cannot reach a bound address:
    that is not supported.

    The syncer side answers ``hello`` through the syncer that :meth:`attach` gave it
    (:meth:`Syncer.serve <compjax.decoupled.Syncer.serve>` attaches itself): a new name is
    registered (a late join) and every learner gets the current global values.  The learner side
    runs a background thread that sends heartbeats and receives frames, so a learner inside a long
    step (a compile) stays alive for the syncer, and a second one that pulls the arrays of each
    reply: :meth:`poll` hands out replies already received, so a transfer never stalls the
    thread that trains.  On the syncer's side, a contribution whose receive fails or takes longer
    than ``pull_timeout_s`` is refused, and its learner's later contributions are refused without
    a pull until that learner says ``hello`` again.  When the syncer restarts (a new id in its
    heartbeats), the learner side says ``hello`` again and hands the learner, through
    :meth:`poll`, one refusal per fragment that carries the restarted syncer's global values and
    versions (``reason`` starts with ``'syncer restarted'``): the learner resumes from them as from
    a stale refusal.

    Attributes:
      address: the syncer's endpoint (on the syncer's side, the one bound: its port if 0 was asked).
      advertise: the IPv4 address this process's transfer server binds and its peers pull from.
      transfer_address: that server's ``HOST:PORT``, the ``address`` field of this side's frames.
      id: this endpoint's random id (the syncer's tells its learners of a restart).
      released: (learner) offers given back at the syncer's request (contributions it refused
        without pulling their arrays).

    Raises:
      ImportError: pyzmq is not installed (``pip install 'compjax[decoupled]'``).
      ValueError: an address that is not a TCP endpoint as above, an ``advertise`` that is not an
        IPv4 address of this machine, a name that is not a non-empty string, or a time <= 0.
    """

    def __init__(self, *, role: str, address: str, name: str | None, heartbeat_s: float, pull_timeout_s: float,
                 advertise: str | None = None, max_tokens: float | None = None, key_file=None,
                 allowed_keys=None, server_key=None, insecure: bool = False, takeover_after_s: float = 5.0):
        zmq = _zmq()
        host, port = parse_endpoint(address, bind=role == "syncer")
        advertise = _check_advertise(advertise)
        check_range("heartbeat_s", heartbeat_s, 0.0, None, lo_open=True)
        check_range("pull_timeout_s", pull_timeout_s, 0.0, None, lo_open=True)
        check_range("takeover_after_s", takeover_after_s, 0.0, None, lo_open=True)
        curve = None
        if role == "syncer":
            if (key_file is None) != (allowed_keys is None):
                raise ValueError("key_file and allowed_keys go together (the syncer's key pair and the learners' "
                                 f"public certificates), got key_file={key_file!r}, allowed_keys={allowed_keys!r}")
            if key_file is None and not insecure and not _is_loopback(host):
                raise ValueError(f"address {address!r} is not a loopback address: anyone who reaches it could "
                                 "contribute; pass key_file= and allowed_keys= (ZeroMQ CURVE), or insecure=True")
            if key_file is not None:
                curve = (*_key_pair(key_file, "key_file"), _allow_list(allowed_keys))
        else:
            if (key_file is None) != (server_key is None):
                raise ValueError("key_file and server_key go together (the learner's key pair and the syncer's "
                                 f"public certificate), got key_file={key_file!r}, server_key={server_key!r}")
            if key_file is not None:
                curve = (*_key_pair(key_file, "key_file"), _public_key(server_key, "server_key"))
        self.secure = curve is not None
        if advertise is None:
            if role == "syncer":
                advertise = local_address_towards("192.0.2.1") if host in ("*", "0.0.0.0") else host
            else:
                advertise = local_address_towards(host, port)
        self.advertise = advertise
        if role != "syncer":  # (the syncer's starts after its socket is bound, below)
            self._server = transfer_server(advertise)  # raises ValueError if this machine cannot bind it
            self.transfer_address = self._server.address()
        self.role, self.name = role, name
        self._max_tokens = None if max_tokens is None else float(max_tokens)  # a learner's declared token cap
        self._heartbeat_s, self._pull_timeout = float(heartbeat_s), float(pull_timeout_s)
        self._ctx = zmq.Context()
        self._zmq = zmq
        self._closed = threading.Event()
        self.id = secrets.token_hex(8)  # this endpoint's id (the syncer's is sent in every heartbeat)
        self._curve = curve
        self._takeover_after = float(takeover_after_s)
        if role == "syncer":
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._auth = None
            if curve is not None:  # every connection authenticated against the allow-list; frames carry User-Id
                self._auth = _authenticator(self._ctx, curve[2])
                self._sock.curve_publickey, self._sock.curve_secretkey = curve[0], curve[1]
                self._sock.curve_server = True
                self._sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # a dead connection is dropped within seconds
                self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
            else:  # a learner restarted under its name takes its place (the name is its identity)
                self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self._routes: dict[str, bytes] = {}  # (CURVE) learner -> the connection it said hello on
            self._heard: dict[str, float] = {}  # (CURVE) learner -> when that connection last spoke
            self._sock.bind(address)
            self.address = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            # The transfer server takes a free port only now: it cannot take the port the syncer was asked to bind.
            try:
                self._server = transfer_server(advertise)  # raises ValueError if this machine cannot bind it
            except ValueError:
                self._sock.close(linger=0)
                if self._auth is not None:
                    self._auth.stop()
                self._ctx.term()
                raise
            self.transfer_address = self._server.address()
            self._syncer = None
            self._record: _Record | None = None
            self._unreachable: set[str] = set()  # learners whose last receive failed, until their next hello
            self._addresses: dict[str, str] = {}  # learner -> the transfer address of its last hello
            # (learner, fragment, shard) -> the frame and arrays of its last reply: offered again if they arrive
            # corrupted (a "resend" frame)
            self._last_reply: dict[tuple[str, int, int], tuple[dict, tuple]] = {}
        else:
            self.address = address
            self._out: queue.Queue = queue.Queue()
            self._inbox: queue.Queue = queue.Queue()  # reply and welcome frames, arrays not yet pulled
            self._ready: queue.Queue = queue.Queue()  # replies whose arrays are local: what poll hands out
            self._welcomes: queue.Queue = queue.Queue()
            self._syncer_id: str | None = None
            self._joined = False
            self._hello_at = 0.0
            self._offers: dict[int, tuple] = {}  # transfer id -> (shapes, dtypes, fragment) of an unanswered send
            self._resends: dict[tuple[int, int, int], int] = {}  # (fragment, version, shard) -> resends asked
            self.released = 0
            self._offers_lock = threading.Lock()
            self._io = threading.Thread(target=self._learner_loop, daemon=True, name=f"compjax-zmq-{name}")
            self._io.start()
            self._receiver = threading.Thread(target=self._receive_loop, daemon=True, name=f"compjax-recv-{name}")
            self._receiver.start()

    @classmethod
    def for_syncer(cls, address: str = "tcp://127.0.0.1:0", *, pull_timeout_s: float = 60.0,
                   advertise: str | None = None, key_file=None, allowed_keys=None, insecure: bool = False,
                   takeover_after_s: float = 5.0) -> MultiProcessTransport:
        """The syncer's side, bound to ``address``.

        **Membership** (ZeroMQ CURVE, through pyzmq's ``zmq.auth``): with ``key_file`` and
        ``allowed_keys`` every connection must authenticate with a key of the allow-list (others
        never get past the handshake), every frame is encrypted, and a learner's name is the one
        its key is listed under: the ``User-Id`` ZeroMQ attaches to its frames, not a name the
        client picks.  A learner's frames count only on the connection it said ``hello`` on; a
        second connection of the same key is refused while the first spoke within
        ``takeover_after_s`` (a restarted learner gets in once its old connection is silent).
        Without keys nothing is authenticated: allowed only on a loopback address, or with
        ``insecure=True``.

        Args:
          address: a ZeroMQ TCP endpoint ``tcp://HOST:PORT``: HOST an IPv4 address of this machine,
            or ``*`` / ``0.0.0.0`` (every interface); port 0: a free one, see :attr:`address`.
          pull_timeout_s: the longest wait for one contribution's arrays to arrive, > 0 (a longer
            receive refuses it, and nothing more is pulled from that learner until its next hello).
          advertise: the IPv4 address the learners reach this machine at, where the syncer's
            transfer server binds (None: HOST, or for ``*`` / ``0.0.0.0`` this machine's address on
            its default route, 127.0.0.1 without one).
          key_file: the syncer's ZeroMQ certificate with its secret key (the ``NAME.key_secret``
            file of ``zmq.auth.create_certificates``), or None.
          allowed_keys: a directory of the learners' public certificates, ``NAME.key`` for learner
            ``NAME`` (the allow-list), or None; given with ``key_file``.
          insecure: bind a non-loopback address without keys (anyone who reaches it may join).
          takeover_after_s: seconds a learner's connection must have been silent before another
            connection of its key may say ``hello`` in its place, > 0.

        Raises:
          ValueError: a malformed ``address``, an ``advertise`` this machine cannot bind, one of
            ``key_file`` and ``allowed_keys`` without the other (or not a certificate / a directory
            of them), or a non-loopback ``address`` without keys and without ``insecure=True``.
        """
        return cls(role="syncer", address=address, name=None, heartbeat_s=1.0, pull_timeout_s=pull_timeout_s,
                   advertise=advertise, key_file=key_file, allowed_keys=allowed_keys, insecure=insecure,
                   takeover_after_s=takeover_after_s)

    @classmethod
    def for_learner(cls, name: str, address: str, *, heartbeat_s: float = 1.0,
                    pull_timeout_s: float = 60.0, advertise: str | None = None,
                    max_tokens: float | None = None, key_file=None, server_key=None) -> MultiProcessTransport:
        """Learner ``name``'s side, connected to the syncer at ``address``; call :meth:`join` next.

        Args:
          name: the learner's name (its ZeroMQ identity), a non-empty string.
          address: the syncer's endpoint, ``tcp://HOST:PORT`` (HOST an IPv4 address or host name,
            PORT 1..65535).
          heartbeat_s: seconds between two heartbeats, > 0.
          pull_timeout_s: the longest wait for one transfer of the syncer's values, > 0 (the reply
            is dropped).
          advertise: the IPv4 address the syncer reaches this machine at, where the learner's
            transfer server binds (None: the local address of this machine's route towards HOST,
            127.0.0.1 for a syncer on this machine).
          max_tokens: the token cap declared in every ``hello`` (the syncer's :meth:`Syncer.register
            <compjax.decoupled.Syncer.register>`), > 0, or None; build the :class:`Learner` with the
            same ``max_tokens``.  A declaration the syncer refuses gets no welcome (logged there).
          key_file: this learner's ZeroMQ certificate with its secret key (``NAME.key_secret``; its
            public half ``NAME.key`` in the syncer's ``allowed_keys``, NAME this learner's
            ``name``), or None (a syncer without keys).
          server_key: the syncer's public certificate (its ``.key`` file), given with ``key_file``.

        Raises:
          ValueError: an empty ``name``, a malformed ``address``, an ``advertise`` this machine
            cannot bind, or ``max_tokens`` <= 0.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        if max_tokens is not None:
            check_range("max_tokens", max_tokens, 0.0, None, lo_open=True)
        return cls(role="learner", address=address, name=name, heartbeat_s=heartbeat_s,
                   pull_timeout_s=pull_timeout_s, advertise=advertise, max_tokens=max_tokens, key_file=key_file,
                   server_key=server_key)

    def _need(self, role: str) -> None:
        if self.role != role:
            raise RuntimeError(f"this is the {self.role}'s side of the transport; that method is the {role}'s")

    def close(self) -> None:
        """Stop the background thread and close the socket (offers already made stay until the process exits).

        A learner that joined says ``goodbye`` first (the syncer's quorum shrinks at once:
        :meth:`Syncer.leave <compjax.decoupled.Syncer.leave>`), waiting up to 1 s for it to be sent.
        """
        if self.role == "learner" and self._joined and not self._closed.is_set():
            self._say({"type": "goodbye"})
            end = time.monotonic() + 1.0
            while not self._out.empty() and time.monotonic() < end:
                time.sleep(0.01)
        self._closed.set()
        if self.role == "learner":
            self._io.join(timeout=10)
            self._receiver.join(timeout=10)  # a pull in progress ends within pull_timeout_s; not waited for longer
        else:
            self._sock.close(linger=1000)  # up to 1 s for the frames still queued (the last replies)
            if self._auth is not None:
                self._auth.stop()
        self._ctx.term()

    # --- syncer side ------------------------------------------------------------------------------------

    def attach(self, syncer) -> None:
        """Answer ``hello`` and heartbeats through ``syncer`` (its ``register`` and ``heartbeat``)."""
        self._need("syncer")
        self._syncer = syncer

    def _send_to(self, identity: bytes, msg: dict) -> None:
        try:
            self._sock.send_multipart([identity, json.dumps(msg).encode()], flags=self._zmq.NOBLOCK)
        except self._zmq.ZMQError as e:  # an unreachable peer: dropped
            logger.info("transport: could not send %s to %r: %s", msg.get("type"), identity, e)

    def _release_last(self) -> None:
        r, self._record = self._record, None
        if r is not None and not r.pulled:
            self._send_to(r.identity, {"type": "release", "uuid": r.uuid})

    def receive(self, timeout: float | None = 0.0) -> Incoming | None:
        self._need("syncer")
        self._release_last()  # the previous header was handled: its offer goes back if it was not pulled
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._sock.poll(None if wait is None else int(wait * 1000)):
                return None
            frames = self._sock.recv_multipart(copy=False)
            if len(frames) < 2:
                continue
            identity, raw = frames[0].bytes, frames[1].bytes
            user = frames[1].get("User-Id") if self.secure else None  # the name of the key that authenticated
            incoming = self._on_frame(identity, raw, user)
            if incoming is not None:
                return incoming

    def _route_of(self, name: str) -> bytes | None:
        """The connection a learner is reached on: (CURVE) the one it said hello on, else its name."""
        return self._routes.get(name) if self.secure else name.encode()

    def _on_frame(self, identity: bytes, raw: bytes, user: str | None = None) -> Incoming | None:
        try:
            msg = json.loads(raw)
            kind = msg["type"]
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("transport: dropped a malformed frame from %r: %s", identity, e)
            return None
        name = user if self.secure else identity.decode(errors="replace")
        registered = not self.secure or self._routes.get(name) == identity
        if registered and self.secure:
            self._heard[name] = time.monotonic()
        if kind == "heartbeat":
            if self._syncer is not None and registered:
                self._syncer.heartbeat(name)
            self._send_to(identity, {"type": "heartbeat", "syncer": self.id})
        elif kind == "hello":
            if self.secure and not registered:
                route, heard = self._routes.get(name), self._heard.get(name, -math.inf)
                if route is not None and time.monotonic() - heard < self._takeover_after:
                    logger.warning("transport: refused a second connection of learner %r: its connection spoke "
                                   "%.1f s ago (a take-over waits until it has been silent for %.1f s)",
                                   name, time.monotonic() - heard, self._takeover_after)
                    return None
                self._routes[name], self._heard[name] = identity, time.monotonic()
            self._welcome(identity, name, msg.get("max_tokens"), msg.get("address"))
        elif kind == "goodbye":
            if self._syncer is not None and registered:
                for reply in self._syncer.leave(name):  # the rounds its leave completed
                    self.reply(reply)
        elif kind == "resend" and registered:
            self._resend(identity, name, msg)
        elif kind == "header" and not registered:
            logger.warning("transport: dropped a header from learner %r on a connection it did not say hello on",
                           name)
            if isinstance(msg.get("uuid"), int):
                self._send_to(identity, {"type": "release", "uuid": msg["uuid"]})
        elif kind == "header":
            try:
                header, uuid, address = _header_from(msg["header"]), int(msg["uuid"]), str(msg["address"])
                crc = int(msg["crc"])
            except (KeyError, TypeError, ValueError) as e:
                logger.warning("transport: dropped a malformed header frame from %r: %s", name, e)
                if isinstance(msg.get("uuid"), int):
                    self._send_to(identity, {"type": "release", "uuid": msg["uuid"]})
                return None
            if header.learner != name:
                logger.warning("transport: dropped a header from %r that claims to be learner %r", name, header.learner)
                self._send_to(identity, {"type": "release", "uuid": uuid})
                return None
            if address != self._addresses.get(name):
                logger.warning("transport: dropped a header from learner %r whose arrays are at %r: the syncer pulls "
                               "only from the address it advertised in its hello (%r)", name, address,
                               self._addresses.get(name))
                self._send_to(identity, {"type": "release", "uuid": uuid})
                return None
            record = self._record = _Record(identity, uuid)

            def pull(h=header):
                if name in self._unreachable:  # not pulled: the learner, if alive, gets a release
                    raise ConnectionError(f"learner {name!r}'s last transfer failed; nothing is pulled from it "
                                          f"until it says hello again")
                record.pulled = True
                try:
                    return _pull(address, uuid, h.shapes, h.dtypes, self._pull_timeout,
                                 f"pull from learner {name!r}", crc)
                except TransferError:  # the transfer ended, its bytes changed: this contribution is refused only
                    logger.warning("transport: the arrays of learner %r's contribution arrived corrupted: refused",
                                   name)
                    raise
                except Exception:
                    self._unreachable.add(name)
                    logger.warning("transport: the transfer from learner %r failed: nothing is pulled from it "
                                   "until it says hello again", name)
                    raise

            return Incoming(header, pull)
        else:
            logger.warning("transport: dropped a frame of unknown type %r from %r", kind, name)
        return None

    def _welcome(self, identity: bytes, name: str, max_tokens=None, address=None) -> None:
        if self._syncer is None:
            logger.warning("transport: hello from %r before a syncer was attached: ignored", name)
            return
        host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
        if not (_is_ipv4(host) and port.isdigit() and 0 < int(port) < 65536):
            logger.warning("transport: hello from %r refused: its transfer address %r is not IPv4 HOST:PORT",
                           name, address)
            return
        self._unreachable.discard(name)  # a learner that says hello is alive: its transfers are pulled again
        try:
            start = self._syncer.register(name, max_tokens=max_tokens)
        except ValueError as e:
            logger.warning("transport: hello from %r refused: %s", name, e)
            return
        self._addresses[name] = address
        flat = [x for values in start.values for x in values]
        uuid, crc = _offer(flat, self._server)
        self._send_to(identity, {
            "type": "welcome", "syncer": self.id, "versions": list(start.versions), "seqs": list(start.seqs),
            "uuid": uuid, "crc": crc,
            "address": self.transfer_address,
            "shapes": [[list(x.shape) for x in values] for values in start.values],
            "dtypes": [[x.dtype.str for x in values] for values in start.values]})

    def _resend(self, identity: bytes, name: str, msg: dict) -> None:
        """Offer again the arrays of the last reply to ``name`` for the fragment (and shard) of ``msg``, if it is
        the version asked for: the learner received them corrupted (:class:`TransferError`)."""
        try:
            key, version = (name, int(msg["fragment"]), int(msg.get("shard", 0))), int(msg["version"])
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("transport: dropped a malformed resend frame from %r: %s", name, e)
            return
        last = self._last_reply.get(key)
        if last is None or int(last[0]["version"]) != version:
            logger.warning("transport: learner %r asked for fragment %d version %d again, which is not its last "
                           "reply: nothing sent", name, key[1], version)
            return
        uuid, crc = _offer(last[1], self._server)
        logger.warning("transport: learner %r received fragment %d version %d corrupted: offered again", name,
                       key[1], version)
        self._send_to(identity, {**last[0], "uuid": uuid, "crc": crc})

    def reply(self, reply: Reply) -> None:
        self._need("syncer")
        r = self._record
        route = self._route_of(reply.learner)
        if route is None:
            logger.info("transport: no connection of learner %r to send its reply to", reply.learner)
            return
        if r is not None and not reply.accepted and r.identity == route and not r.pulled:
            self._release_last()  # a header refused before its pull: the learner drops its offer now
        msg = {"type": "reply", "learner": reply.learner, "fragment": reply.fragment, "version": reply.version,
               "accepted": reply.accepted, "reason": reply.reason, "uuid": None, "shard": reply.shard}
        arrays = reply.arrays()  # the whole values, or the compressed update (``"update": true``)
        if reply.values is not None or reply.update is not None:
            uuid, crc = _offer(arrays, self._server)
            self._last_reply[(reply.learner, int(reply.fragment), int(reply.shard))] = (msg, arrays)
            msg.update(uuid=uuid, crc=crc, address=self.transfer_address,
                       shapes=[list(x.shape) for x in arrays], dtypes=[x.dtype.str for x in arrays],
                       update=reply.values is None)
        self._send_to(route, msg)

    # --- learner side -----------------------------------------------------------------------------------

    def _learner_loop(self) -> None:
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:  # the key names the learner; the connection id is random (none can take it)
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self._curve
            sock.setsockopt(zmq.ROUTING_ID, b"c" + secrets.token_hex(12).encode())
        else:
            sock.setsockopt(zmq.ROUTING_ID, self.name.encode())
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.connect(self.address)
        beat = 0.0
        try:
            while not self._closed.is_set():
                while True:
                    try:
                        sock.send(self._out.get_nowait(), flags=zmq.NOBLOCK)
                    except queue.Empty:
                        break
                    except zmq.ZMQError as e:
                        logger.info("learner %r: a frame could not be queued: %s", self.name, e)
                if time.monotonic() - beat >= self._heartbeat_s:
                    beat = time.monotonic()
                    try:
                        sock.send(json.dumps({"type": "heartbeat"}).encode(), flags=zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
                if sock.poll(50):
                    self._on_learner_frame(sock.recv())
        finally:
            sock.close(linger=0)

    def _hello(self) -> dict:
        msg = {"type": "hello", "address": self.transfer_address}  # the only address the syncer will pull from
        if self._max_tokens is not None:
            msg["max_tokens"] = self._max_tokens
        return msg

    def _say(self, msg: dict) -> None:
        self._out.put(json.dumps(msg).encode())

    def _on_learner_frame(self, raw: bytes) -> None:
        try:
            msg = json.loads(raw)
            kind = msg["type"]
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("learner %r: dropped a malformed frame: %s", self.name, e)
            return
        if kind == "heartbeat":
            # A new id: the syncer restarted.  Say hello (again every 5 s until a welcome sets the new id).
            if self._joined and msg.get("syncer") != self._syncer_id and time.monotonic() - self._hello_at > 5.0:
                logger.warning("learner %r: the syncer restarted (id %s): rejoining", self.name, msg.get("syncer"))
                self._hello_at = time.monotonic()
                self._say(self._hello())
        elif kind == "welcome":
            if self._joined and msg.get("syncer") == self._syncer_id:  # the answer to a repeated hello
                logger.info("learner %r: ignored a second welcome from syncer %s", self.name, self._syncer_id)
                return
            self._syncer_id = msg.get("syncer")
            (self._inbox if self._joined else self._welcomes).put(msg)
        elif kind == "reply":
            self._inbox.put(msg)
        elif kind == "release":
            with self._offers_lock:
                offer = self._offers.pop(msg.get("uuid"), None)
            if offer is not None:  # pull our own offer: the transfer server lets go of the arrays
                try:
                    _pull(self.transfer_address, msg["uuid"], offer[0], offer[1], self._pull_timeout, "release")
                    self.released += 1
                except Exception as e:  # noqa: BLE001 - a release that fails leaves one offer behind
                    logger.info("learner %r: releasing offer %s failed: %s", self.name, msg["uuid"], e)

    def join(self, timeout: float | None = None) -> Start:
        """Say ``hello`` and wait for the syncer's ``welcome``: the starting point for :class:`Learner`'s ``start``.

        Raises:
          TimeoutError: no welcome within ``timeout`` seconds (None: wait forever).
        """
        self._need("learner")
        end = None if timeout is None else time.monotonic() + timeout
        msg = None
        while msg is None:  # hello again every 5 s: a refused one (e.g. an old connection still alive) is retried
            self._hello_at = time.monotonic()
            self._say(self._hello())
            wait = 5.0 if end is None else min(5.0, end - time.monotonic())
            try:
                msg = self._welcomes.get(timeout=max(0.0, wait))
            except queue.Empty:
                if end is not None and time.monotonic() >= end:
                    raise TimeoutError(f"learner {self.name!r}: no welcome from the syncer at {self.address} "
                                       f"within {timeout} s") from None
        self._joined = True
        return self._start_of(msg)

    def _start_of(self, msg: dict) -> Start:
        flat_shapes = [s for frag in msg["shapes"] for s in frag]
        flat_dtypes = [d for frag in msg["dtypes"] for d in frag]
        flat = list(_pull(msg["address"], int(msg["uuid"]), flat_shapes, flat_dtypes, self._pull_timeout,
                          "pull of the syncer's global values", int(msg["crc"])))
        values = []
        for frag in msg["shapes"]:
            values.append(tuple(flat[:len(frag)]))
            flat = flat[len(frag):]
        return Start(tuple(values), tuple(int(v) for v in msg["versions"]), tuple(int(v) for v in msg.get("seqs", ())))

    def send(self, contribution: Contribution) -> None:
        self._need("learner")
        h = contribution.header
        uuid, crc = _offer(contribution.values, self._server)
        with self._offers_lock:
            self._offers[uuid] = (tuple(np.shape(v) for v in contribution.values),
                                  tuple(np.dtype(v.dtype).str for v in contribution.values), (h.fragment, h.shard))
        self._say({"type": "header", "header": _header_dict(h), "uuid": uuid, "crc": crc,
                   "address": self.transfer_address})

    def abandon(self, learner: str, fragment: int) -> None:
        """Let go of the offers of ``fragment``'s unanswered sends (their arrays leave the transfer server)."""
        self._need("learner")
        with self._offers_lock:
            gone = [(u, o) for u, o in self._offers.items() if o[2][0] == int(fragment)]
            for u, _ in gone:
                del self._offers[u]
        for uuid, (shapes, dtypes, _) in gone:  # pull our own offer: the transfer server lets go of the arrays
            try:
                _pull(self.transfer_address, uuid, shapes, dtypes, self._pull_timeout, "abandon")
            except Exception as e:  # noqa: BLE001 - one offer left behind, logged
                logger.info("learner %r: letting go of offer %s failed: %s", self.name, uuid, e)

    def _receive_loop(self) -> None:
        """Pull the arrays of each reply (and of a restarted syncer's welcome) off the training thread."""
        while not self._closed.is_set():
            try:
                msg = self._inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                for reply in self._replies_of(msg):
                    self._ready.put(reply)
            except TransferError as e:
                if msg.get("type") == "reply" and self._ask_again(msg):
                    logger.warning("learner %r: %s; asked the syncer to send it again", self.name, e)
                else:
                    logger.warning("learner %r: dropped a reply that could not be received: %s: %s",
                                   self.name, type(e).__name__, e)
            except Exception as e:  # noqa: BLE001 - a reply that cannot be received is dropped
                logger.warning("learner %r: dropped a reply that could not be received: %s: %s",
                               self.name, type(e).__name__, e)

    def _ask_again(self, msg: dict) -> bool:
        """Ask the syncer to offer the arrays of reply ``msg`` again (at most :data:`RESENDS` times a reply)."""
        key = (int(msg["fragment"]), int(msg["version"]), int(msg.get("shard", 0)))
        if self._resends.get(key, 0) >= RESENDS:
            del self._resends[key]  # given up: the count is kept only while a resend is awaited
            return False
        self._resends[key] = self._resends.get(key, 0) + 1
        self._say({"type": "resend", "fragment": key[0], "version": key[1], "shard": key[2]})
        return True

    def _replies_of(self, msg: dict) -> list[Reply]:
        if msg["type"] == "welcome":  # a restarted syncer: resume from its state, fragment by fragment
            start = self._start_of(msg)
            why = f"{RESTARTED}: resuming from its global model at versions {list(start.versions)}"
            logger.warning("learner %r: %s", self.name, why)
            return [Reply(self.name, p, v, vals, accepted=False, reason=why)
                    for p, (vals, v) in enumerate(zip(start.values, start.versions))]
        values = None
        if msg.get("uuid") is not None:
            values = _pull(msg["address"], int(msg["uuid"]), msg["shapes"], msg["dtypes"],
                           self._pull_timeout, "pull of a merged fragment", int(msg["crc"]))
        shard = int(msg.get("shard", 0))
        self._resends.pop((int(msg["fragment"]), int(msg["version"]), shard), None)  # arrived intact
        with self._offers_lock:  # this fragment's (shard's) offers were pulled, or released before this reply
            for uuid in [u for u, o in self._offers.items() if o[2] == (int(msg["fragment"]), shard)]:
                del self._offers[uuid]
        update = None
        if msg.get("update"):
            values, update = None, values
        return [Reply(self.name, int(msg["fragment"]), int(msg["version"]), values,
                      accepted=bool(msg["accepted"]), reason=str(msg["reason"]), update=update, shard=shard)]

    def poll(self, learner: str, timeout: float | None = 0.0) -> Reply | None:
        """The next reply whose arrays are already local, waiting up to ``timeout`` seconds (None: forever).

        The arrays are pulled by the transport's background thread as soon as the reply frame
        arrives, so ``poll(timeout=0)`` never waits for a transfer; with a timeout it waits until
        a reply is received (the lock-step learner's ``wait_for_merge``).
        """
        self._need("learner")
        try:
            return self._ready.get(block=timeout is None or timeout > 0, timeout=timeout)
        except queue.Empty:
            return None

    def __repr__(self) -> str:
        return (f"MultiProcessTransport(role={self.role!r}, name={self.name!r}, address={self.address!r}, "
                f"advertise={self.advertise!r})")
