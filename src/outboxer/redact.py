"""One place that decides what a secret looks like, used by every log line, error and API answer.

Three kinds of secret reach outboxer: the password in a URL (``amqp://u:PASS@host``), a
whole user part that is itself the credential (``nats://TOKEN@host``), and query options
that carry keys (``?api_key=…``, ``?code=…``, ``?sasl_password=…``). ``redact_url`` hides
all three; ``redact_text`` finds URLs inside free text (a driver's exception message) and
hides theirs, and also any value registered with ``register_secret`` (a webhook signing
secret or an HTTP token is not in a URL, yet may be echoed by a library's error).

``RedactingFilter`` applies ``redact_text`` to log records. Every outboxer logger carries
it (``get_logger``), so records are clean before any handler of the application sees them.
"""

from __future__ import annotations

import logging
import re
import threading
from urllib.parse import unquote, urlsplit, urlunsplit

MASK = "***"

#: A query option whose lower-cased name contains one of these carries a credential.
#: Broad on purpose: hiding a harmless value costs a little debugging, showing a key costs a
#: rotation. "key" covers api_key, apikey, access_key, ssl_keyfile; "code" Azure-style
#: function codes; "sig" signed URLs.
SECRET_OPTION_WORDS = (
    "pass",
    "pwd",
    "secret",
    "token",
    "key",
    "code",
    "auth",
    "cred",
    "sig",
    "session",
    "cookie",
    "jwt",
    "seed",
)

#: Schemes whose bare user part (no ``:password``) is a token, not a user name.
TOKEN_USER_SCHEMES = frozenset({"nats", "tls", "ws", "wss"})

#: Registered secrets shorter than this are not searched for in free text: masking every
#: "test" or "guest" in every line would garble logs, and URL redaction already covers them.
MIN_REGISTERED_SECRET = 8

#: The longest port (65535): a longer "port" that is no number may be a password.
LONGEST_PORT = 5

_URL_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]{1,30}://[^\s'\"<>`]+")
#: ``user:password@host`` without a scheme (a mistyped URL): the password is hidden too.
_BARE_CREDENTIALS = re.compile(r"(?<![\w/:])([\w.%+\-]+):([^\s@/:'\"]+)@")
_registered: set[str] = set()
_registered_lock = threading.Lock()


def is_secret_option(name: str) -> bool:
    """Whether a query option or adapter option of this name holds a credential."""
    lowered = unquote(name).lower()
    return any(word in lowered for word in SECRET_OPTION_WORDS)


def redact_url(url: str) -> str:
    """``url`` with its password, token user part and secret query values replaced by ``***``.

    Never raises: a string that does not parse as a URL is returned through ``redact_text``'s
    registered-secret masking only, so an error message about a malformed URL stays useful
    without echoing a password (the netloc is masked whole when it cannot be split).
    """
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
    except ValueError:
        return _mask_registered(re.sub(r"//[^/?#]*@", f"//{MASK}@", url))
    mangled = split_unencoded_userinfo(url)
    if mangled is not None:
        user, _, rest = mangled
        head = f"{user}:{MASK}@" if user else f"{MASK}@"
        return redact_url(f"{parts.scheme}://{rest}").replace("://", f"://{head}", 1)
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        netloc = hosts = _mask_non_numeric_ports(hosts)
    if at:
        user, has_password, _ = userinfo.partition(":")
        if has_password:
            netloc = f"{user}:{MASK}@{hosts}"
        elif parts.scheme.lower() in TOKEN_USER_SCHEMES:
            netloc = f"{MASK}@{hosts}"
    fragment = MASK if parts.fragment else ""
    return _mask_registered(
        urlunsplit(parts._replace(netloc=netloc, query=_mask_query(parts.query), fragment=fragment))
    )


def _mask_query(query: str) -> str:
    return "&".join(
        f"{pair.partition('=')[0]}={MASK}" if is_secret_option(pair.partition("=")[0]) else pair
        for pair in query.split("&")
        if pair
    )


def _mask_non_numeric_ports(hosts: str) -> str:
    """``hosts`` of a URL without user part (``h:5432,h2:x``), every port that is no number
    masked.

    ``amqp://guest:PASSWORD`` (its ``@host`` forgotten, or an ``OUTBOXER_DB`` list cut at a
    space in a password) parses as host ``guest``, port ``PASSWORD``. A mistyped port
    (``h:abc``, at most five characters like any port) stays, to be seen and fixed; a bracketed
    IPv6 host cannot be a user name, so its port stays too.
    """
    shown = []
    for host in hosts.split(","):
        name, colon, port = host.rpartition(":")
        # Free text may end the URL with punctuation: "(cannot connect to amqp://h:5672)".
        digits = port.rstrip(")]}>.,;:!'\"")
        if colon and len(digits) > LONGEST_PORT and "]" not in host and not digits.isdigit():
            host = f"{name}:{MASK}"
        shown.append(host)
    return ",".join(shown)


#: The scheme and slashes a value meant as a URL starts with (``postgres:/``, ``s3//``).
_URL_HEAD = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:?/*|/*")


def redact_malformed_url(text: str) -> str:
    """A value meant as a URL that is none (``postgres:/app:PW@db``, ``s3//b?secret_key=…``):
    what would be its user part, its secret query values and its fragment masked.

    ``redact_text`` finds URLs by their ``://``; without it, a mistyped URL would be echoed
    whole by the error that refuses it.
    """
    rest, hash_sign, _ = text.partition("#")
    rest, question, query = rest.partition("?")
    head = _URL_HEAD.match(rest)
    start = head.end() if head else 0
    userinfo, at, hosts = rest[start:].rpartition("@")
    if at:
        user, has_password, _ = userinfo.partition(":")
        rest = f"{rest[:start]}{f'{user}:{MASK}' if has_password else MASK}@{hosts}"
    if question:
        rest = f"{rest}?{_mask_query(query)}"
    if hash_sign:
        rest = f"{rest}#{MASK}"
    return _mask_registered(rest)


def split_unencoded_userinfo(url: str) -> tuple[str, str, str] | None:
    """``(user, secret, rest)`` when ``url``'s password (or token) holds an unencoded ``/``,
    ``?`` or ``#``, else None.

    ``urlsplit`` ends the host part at the first of those, so ``postgres://app:Ab/cd@db/app``
    parses as host ``app``, port ``Ab`` and path ``/cd@db/app``: no ``@`` in the netloc, and
    the password would go unmasked. Such a URL is taken to hold a secret up to its last
    ``@`` (generated base64 passwords often contain ``/``); ``rest`` is what follows it.
    """
    scheme, sep, after = url.partition("://")
    if not sep or not scheme:
        return None
    netloc_end = min((i for i in (after.find(c) for c in "/?#") if i >= 0), default=len(after))
    netloc, remainder = after[:netloc_end], after[netloc_end:]
    if "@" in netloc or "@" not in remainder:
        return None
    if ":" not in netloc and scheme.lower() not in TOKEN_USER_SCHEMES:
        return None  # a plain host: an "@" in the path or query is just data
    userinfo, _, rest = after.rpartition("@")
    user, has_password, secret = userinfo.partition(":")
    return (user, secret, rest) if has_password else ("", userinfo, rest)


def redact_text(text: str) -> str:
    """Free text with every URL in it redacted and every registered secret masked."""
    text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    text = _BARE_CREDENTIALS.sub(lambda m: f"{m.group(1)}:{MASK}@", text)
    return _mask_registered(text)


#: C0 controls, DEL, C1 controls, the Unicode line and paragraph separators (a line break
#: for str.splitlines() and JavaScript) and the invisible bidirectional marks and overrides.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: object) -> str:
    """``text`` for a terminal or a text log line, its control characters escaped (``\\x1b``).

    Topics, keys, error text and dead letters come from applications, brokers and remote
    servers: raw, an ESC could clear the screen or retitle the window, a newline could forge
    a log line, a bidirectional override could reorder what an operator reads.
    """
    return _UNPRINTABLE.sub(_escape_char, str(text))


#: At most this many characters of a value's repr go into an error or a log line (shown_value).
SHOWN_VALUE_CHARS = 80


def shown_value(value: object) -> str:
    """``value`` as an error or a log line may carry it: its repr, cut and escaped. An id
    comes off the wire, from any producer: megabytes of it would flood the log, a newline
    forge a line, an ESC drive the operator's terminal. The length kept says how much was
    cut (a 36-character UUID gone wrong reads differently from a megabyte of something)."""
    text = repr(value)
    if len(text) > SHOWN_VALUE_CHARS:
        text = f"{text[:SHOWN_VALUE_CHARS]}… ({len(text)} characters)"
    return printable(text)


def _escape_char(match: re.Match[str]) -> str:
    code = ord(match.group(0))
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def register_secret(value: str | None) -> None:
    """Mask ``value`` wherever it appears in redacted text from now on (process-wide)."""
    if value and len(value) >= MIN_REGISTERED_SECRET:
        with _registered_lock:
            _registered.add(value)


def register_url_secrets(url: str | None) -> None:
    """Register the password, token user part and secret query values of ``url``."""
    if not url:
        return
    try:
        parts = urlsplit(url)
        userinfo, at, _ = parts.netloc.rpartition("@")
    except ValueError:
        return
    mangled = split_unencoded_userinfo(url)
    if mangled is not None:
        register_secret(mangled[1])
        register_secret(unquote(mangled[1]))
        return
    if at:
        user, has_password, password = userinfo.partition(":")
        register_secret(unquote(password) if has_password else None)
        if not has_password and parts.scheme.lower() in TOKEN_USER_SCHEMES:
            register_secret(unquote(user))
    for pair in parts.query.split("&"):
        name, _, value = pair.partition("=")
        if is_secret_option(name):
            register_secret(unquote(value))


def _mask_registered(text: str) -> str:
    if not _registered:
        return text
    with _registered_lock:
        secrets = sorted(_registered, key=len, reverse=True)  # longest first: no partial leftovers
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


class RedactingFilter(logging.Filter):
    """Rewrites a record's message (and its traceback text) through ``redact_text``."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a malformed %-format: keep the raw parts, redacted
            message = f"{record.msg} {record.args}"
        record.msg = redact_text(message)
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        return True


_FILTER = RedactingFilter()


#: A logger, or one that adds context to each line (the relay's: its database).
Log = logging.Logger | logging.LoggerAdapter[logging.Logger]


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` carrying the redacting filter (once)."""
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger


__all__ = [
    "MASK",
    "Log",
    "RedactingFilter",
    "get_logger",
    "is_secret_option",
    "printable",
    "printable_lines",
    "redact_malformed_url",
    "redact_text",
    "redact_url",
    "register_secret",
    "register_url_secrets",
]


def printable_lines(text: str) -> str:
    """``text`` with each line's control characters escaped, its line breaks kept."""
    return "\n".join(printable(line) for line in text.split("\n"))


class TextFormatter(logging.Formatter):
    """The text log format, one line per record: the message's control characters escaped
    (see ``printable``); a traceback keeps its lines, each escaped (an exception's text may
    come from a broker, a remote server or a message)."""

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        # exc_text is the record's, shared with the other handlers: escaped for this line only.
        exc_text = record.exc_text
        if exc_text:
            record.exc_text = printable_lines(exc_text)
        try:
            return super().format(record)
        finally:
            record.exc_text = exc_text

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)

    def formatStack(self, stack_info: str) -> str:
        return printable_lines(super().formatStack(stack_info))
