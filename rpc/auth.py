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
import secrets

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
