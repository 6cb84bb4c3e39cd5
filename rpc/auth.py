"""Mutual HMAC challenge-response against the cluster secret.

Runs once per connection, before any frame::

    server -> client   b"SFSA" | server_nonce(32)
    client -> server   client_nonce(32) | HMAC(secret, b"client" | server_nonce | client_nonce)
    server -> client   b"OK" | HMAC(secret, b"server" | client_nonce | server_nonce)
                       (or the server closes the connection)

Both sides prove they hold the secret without sending it; fresh nonces on both
sides stop replay. The secret never leaves the files it is stored in (mode 0600).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
from pathlib import Path

import trio

from shufflefs.rpc.errors import FsError
from shufflefs.rpc.transport import FrameStream

GREETING = b"SFSA"
NONCE = 32
MAC = hashlib.sha256().digest_size
HANDSHAKE_TIMEOUT = 5.0


def proof(secret: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    """HMAC(secret, role | a | b): what each side sends to prove it holds the secret."""
    return hmac.new(secret, role + a + b, hashlib.sha256).digest()


async def server_handshake(stream: FrameStream, secret: bytes) -> None:
    """Authenticate a connecting client; raise FsError(EACCES) to refuse it."""
    with trio.move_on_after(HANDSHAKE_TIMEOUT) as scope:
        server_nonce = secrets.token_bytes(NONCE)
        await stream.send_raw(GREETING + server_nonce)
        reply = await stream.receive_exactly(NONCE + MAC)
        client_nonce, client_mac = reply[:NONCE], reply[NONCE:]
        if not hmac.compare_digest(
            client_mac, proof(secret, b"client", server_nonce, client_nonce)
        ):
            raise FsError(errno.EACCES, "authentication failed: wrong cluster secret")
        await stream.send_raw(b"OK" + proof(secret, b"server", client_nonce, server_nonce))
    if scope.cancelled_caught:
        raise FsError(errno.ETIMEDOUT, "authentication handshake timed out")


async def client_handshake(stream: FrameStream, secret: bytes) -> None:
    """Authenticate to a server and check that it, too, holds the secret."""
    with trio.move_on_after(HANDSHAKE_TIMEOUT) as scope:
        hello = await stream.receive_exactly(len(GREETING) + NONCE)
        if hello[: len(GREETING)] != GREETING:
            raise FsError(errno.EPROTO, "peer is not a shufflefs server")
        server_nonce = hello[len(GREETING) :]
        client_nonce = secrets.token_bytes(NONCE)
        await stream.send_raw(client_nonce + proof(secret, b"client", server_nonce, client_nonce))
        answer = await stream.receive_exactly(2 + MAC)
        if answer[:2] != b"OK" or not hmac.compare_digest(
            answer[2:], proof(secret, b"server", client_nonce, server_nonce)
        ):
            raise FsError(errno.EACCES, "server failed authentication: wrong cluster secret")
    if scope.cancelled_caught:
        raise FsError(errno.ETIMEDOUT, "authentication handshake timed out")


def generate_secret(path: Path) -> bytes:
    """Create a new random cluster secret file readable by its owner only."""
    secret = secrets.token_hex(32).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secret + b"\n")
    finally:
        os.close(fd)
    return secret


def load_secret(path: Path) -> bytes:
    """Read a cluster secret; refuse files others can read (like ssh does)."""
    try:
        st = path.stat()
        data = path.read_bytes().strip()
    except FileNotFoundError:
        raise FsError(errno.ENOENT, f"cluster secret file {path} not found") from None
    except PermissionError:
        raise FsError(errno.EACCES, f"cannot read cluster secret file {path}") from None
    if st.st_mode & 0o077:
        raise FsError(
            errno.EPERM,
            f"cluster secret file {path} is accessible by others "
            f"(mode {st.st_mode & 0o777:o}); run: chmod 600 {path}",
        )
    if len(data) < 16:
        raise FsError(errno.EINVAL, f"cluster secret file {path} is too short")
    return data
