"""TLS contexts: the router's own HTTPS listener (`tls`) and its view of `https://` engines
(`engine.ca_file`). The listener's certificate and key are re-read on every reload, into the
same context, so new connections get a rotated certificate without a restart."""

from __future__ import annotations

import ssl

from narwhal.config import ConfigError, TlsConfig


def server_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """The listener's context, or None without `tls` (ConfigError naming the key when the
    files cannot be loaded)."""
    if not tls.enabled:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    load(context, tls)
    return context


def load(context: ssl.SSLContext, tls: TlsConfig) -> None:
    """(Re)load the certificate chain and key into `context` (blocking: small files)."""
    assert tls.cert_file is not None and tls.key_file is not None
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    except FileNotFoundError as exc:
        key = "tls.key_file" if exc.filename == tls.key_file else "tls.cert_file"
        raise ConfigError([f"{key}: cannot read: {exc.strerror}"]) from None
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError([f"tls.cert_file: cannot load the certificate and key: {exc}"]) from None


def engine_context(ca_file: str | None) -> ssl.SSLContext | None:
    """How `https://` engines are verified: against `ca_file`, or (None) the system's CAs."""
    if ca_file is None:
        return None
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError([f"engine.ca_file: cannot load: {exc}"]) from None
