"""Secrets out of what batchlens shows: the one function that masks a URL's password, and its use on free text.

Every URL batchlens prints, logs, returns from an endpoint or writes to ``config show`` passes through
:func:`mask_url`; the command line's log formatter (cli.py) runs :func:`mask_urls_in` over every line, so a
URL that a message or an exception carries is masked too, whoever wrote the line. No third-party import: the
formatter is installed before any command loads.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import urlsplit, urlunsplit

# A URL with user info inside free text: scheme://<no space, slash or @>@<up to the next space or quote>.
_URL_WITH_USERINFO = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s/@'\"]*@[^\s'\"]*")


def mask_url(url: str) -> str:
    """``url`` with its password, if it has one, as ``***``: fit for a log line, an error message or an answer."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL urllib can split (a bad port, a broken IPv6 host): its user info is dropped
        scheme, sep, rest = url.partition("://")
        return f"{scheme}{sep}***@{rest.rpartition('@')[2]}" if sep and "@" in rest else url
    if password is None:
        return url
    netloc = f"{parts.username}:***@{parts.netloc.rpartition('@')[2]}"  # the host as written: [::1] keeps its brackets
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def mask_urls_in(text: str) -> str:
    """``text`` with every URL in it passed through :func:`mask_url`."""
    return _URL_WITH_USERINFO.sub(lambda m: mask_url(m.group(0)), text) if "://" in text else text


class MaskingFormatter(logging.Formatter):
    """A log formatter whose every line, traceback included, has its URLs' passwords masked."""

    def format(self, record: logging.LogRecord) -> str:
        return mask_urls_in(super().format(record))
