"""Authenticated ZMQ sockets between the API process and the engine ranks.

The process that binds (the API process, or the offline ``LLM``) is a CURVE server; the ranks
connect as CURVE clients. Both sides hold keys made for this launch: a peer without the client
key cannot complete the handshake, so it can neither read requests nor push outputs, and all
traffic is encrypted. On one node the keys are random and reach the ranks through the spawn
pipe; across nodes every node derives the same keys from a secret file the operator shares.
Decoding (``io.Codec``) is the second guard: a message that passes the handshake still has to
match its schema.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator

# ZMQ drops larger messages before they are read: a request is at most a context of token ids
MAX_MESSAGE_BYTES = 64 << 20

logger = logging.getLogger(__name__)
ZAP_DOMAIN = "moeserve"
TERM_TIMEOUT_S = 5.0
# A rank's sockets: a send that cannot leave (the API process is behind, or gone) wakes this often
# so the rank can look whether its parent still lives; unsent messages outlive a close this long.
RANK_SEND_TIMEOUT_MS = 1000
RANK_LINGER_MS = 1000


@dataclass(frozen=True)
class ChannelKeys:
    """CURVE keys (Z85 text) of one launch: the binding side's pair and the ranks' pair."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def generate(cls) -> ChannelKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    @classmethod
    def from_secret(cls, secret: bytes) -> ChannelKeys:
        """The same keys on every node that reads the same secret."""
        if len(secret) < 16:
            raise ValueError("the shared secret must have at least 16 bytes")
        server_secret = zmq.utils.z85.encode(hmac.new(secret, b"moeserve-server", hashlib.sha256).digest())
        client_secret = zmq.utils.z85.encode(hmac.new(secret, b"moeserve-client", hashlib.sha256).digest())
        return cls(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret)


class Refusals:
    """The ZAP handler's verdict on each connecting peer: only the launch's client key passes."""

    def __init__(self, allowed: bytes) -> None:
        self.allowed = allowed
        self.count = 0
        self._lock = threading.Lock()

    def callback(self, domain: str, key: bytes) -> bool:
        ok = hmac.compare_digest(key, self.allowed)
        if not ok:
            with self._lock:
                self.count += 1
            logger.warning("refused a ZMQ peer with an unknown key")
        return ok


class ServerSide:
    """Binds sockets of one ZMQ context as CURVE servers, with a ZAP handler thread that admits
    only the launch's client key. A context of ``zmq.asyncio`` works too (the handler runs on a
    synchronous shadow of it).

    It owns the context from here on: ``close()``, or the object's garbage collection or the
    interpreter's exit, closes the sockets it bound, stops the ZAP handler and ends the context,
    each wait bounded."""

    def __init__(self, ctx: zmq.Context, keys: ChannelKeys) -> None:
        self.ctx, self.keys = ctx, keys
        self.refusals = Refusals(keys.client_public)
        self._sockets: list[zmq.Socket] = []
        self._auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
        # registered before the handler starts: a failed start still ends the context
        self._release = weakref.finalize(self, release, ctx, self._auth, self._sockets, os.getpid())
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self.refusals)

    def bind(self, kind: int, addr: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        self._sockets.append(sock)
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = self.keys.server_public, self.keys.server_secret
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP verdict, no connection
        sock.maxmsgsize = MAX_MESSAGE_BYTES
        sock.bind(addr)
        return sock

    def stop(self, timeout: float = TERM_TIMEOUT_S) -> bool:
        """Stop the ZAP handler (``stop_authenticator``)."""
        return stop_authenticator(self._auth, timeout)

    def close(self, sockets: Iterable[zmq.Socket] = (), timeout: float = TERM_TIMEOUT_S) -> bool:
        """Close ``sockets`` and every socket bound here (no linger), stop the ZAP handler, then end
        the context, waiting at most ``timeout`` seconds for each. True when the context ended in
        time. A second call does nothing.

        libzmq can leave ``zmq_ctx_term`` waiting forever for a CURVE server socket that was
        mid-handshake with a ZAP request out when it closed (libzmq#2733, seen on loaded
        machines); shutting down must not hang on it, so the wait is bounded and a context that
        does not end is left to the process's exit."""
        for sock in sockets:
            sock.close(linger=0)
        state = self._release.detach()
        if state is None:
            return self.ctx.closed
        _, _, (ctx, auth, bound, pid), _ = state
        return release(ctx, auth, bound, pid, timeout)


def release(ctx: zmq.Context, auth: ThreadAuthenticator, sockets: list[zmq.Socket], owner_pid: int,
            timeout: float = TERM_TIMEOUT_S) -> bool:
    """``ServerSide``'s end, over what it owns and never the object itself (its finalizer): close
    ``sockets`` with no linger, stop the ZAP handler, end ``ctx``; each wait at most ``timeout`` s.
    Nothing in a process other than ``owner_pid`` (a forked child inherits the finalizer)."""
    if os.getpid() != owner_pid:
        return False
    for sock in sockets:
        sock.close(linger=0)
    stop_authenticator(auth, timeout)
    return terminate(ctx, timeout)


def stop_authenticator(auth: ThreadAuthenticator, timeout: float = TERM_TIMEOUT_S) -> bool:
    """Stop ``auth``'s thread, waiting at most ``timeout`` seconds (pyzmq's ``stop`` joins without a
    bound, and sends with none once the thread is gone). True when the thread ended; if it did not,
    its sockets stay open (they then hold the context open, whose end is bounded too) rather than
    be closed under a running thread."""
    thread, pipe = auth.thread, auth.pipe
    if thread is None or pipe is None:
        return True
    with contextlib.suppress(zmq.ZMQError):
        pipe.send(b"TERMINATE", zmq.NOBLOCK)
    thread.join(timeout)
    stopped = not thread.is_alive()
    if stopped:
        for sock in (pipe, auth.zap_socket):
            if sock is not None:
                sock.close(linger=0)
    else:
        logger.warning("the ZAP handler did not stop within %.0f s; left to the process's exit", timeout)
    auth.thread = auth.pipe = auth.zap_socket = None  # so ThreadAuthenticator.__del__ does nothing
    return stopped


def terminate(ctx: zmq.Context, timeout: float = TERM_TIMEOUT_S) -> bool:
    """``ctx.destroy(linger=0)`` on a daemon thread, waited for at most ``timeout`` seconds."""
    done = threading.Thread(target=ctx.destroy, kwargs={"linger": 0}, daemon=True, name="zmq-term")
    done.start()
    done.join(timeout)
    if done.is_alive():
        logger.warning("a ZMQ context did not end within %.0f s; left to the process's exit", timeout)
    return not done.is_alive()


def connect(ctx: zmq.Context, kind: int, addr: str | Iterable[str], keys: ChannelKeys) -> zmq.Socket:
    """A CURVE client socket that trusts only the launch's server key, connected to ``addr`` (or
    to each of several addresses: a PULL then fair-queues what they all send)."""
    sock = ctx.socket(kind)
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey, sock.curve_secretkey = keys.client_public, keys.client_secret
    sock.maxmsgsize = MAX_MESSAGE_BYTES
    for one in [addr] if isinstance(addr, str) else addr:
        sock.connect(one)
    return sock
