"""The public base URL a component's UnifiedPush endpoints are built on, in ASCII.

Endpoints (`<base>/push/<token>`) go to application servers, and message resources
(`<base>/push/message/<reference>`) go back in a POST's `Location` header, which must be
ASCII. A host typed in Unicode (`http://пример.example`) is stored in its IDNA form
(`http://xn--e1afmkfd.example`); what cannot be written so is refused when it is saved
(`normalized`, through `ComponentSettings.clean_fields`, the admin and `load_tenants`). Rows saved
before that rule are served through `ascii_form`, which never fails.
"""

from __future__ import annotations

from urllib.parse import quote, urlsplit, urlunsplit

from django.core.exceptions import ValidationError
from django.core.validators import URLValidator

MAX_LENGTH = 200  # the model field's; endpoints must stay within 1000 bytes
# Characters a path keeps as they are (RFC 3986 pchar and "/", "%" of escapes already made).
_PATH_SAFE = "/%:@!$&'()*+,;=~"
_URL_SAFE = _PATH_SAFE + "?#[]"
_validate_url = URLValidator(schemes=["http", "https"])


def normalized(url: str) -> str:
    """`url` as stored: an http(s) base URL without user, query or fragment, its host in
    IDNA and its path percent-encoded; ValidationError with the reason otherwise."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        raise ValidationError("Enter a valid http:// or https:// URL.") from None
    if parts.scheme not in ("http", "https"):
        raise ValidationError("Use an http:// or https:// URL.")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValidationError("Give a base URL without user, query or fragment.")
    netloc = parts.netloc
    if not netloc.isascii():
        host = parts.hostname or ""
        try:
            ascii_host = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise ValidationError(
                f"The host name {host!r} cannot be written in ASCII (IDNA): each part at "
                "most 63 characters, none empty, no invisible or forbidden characters."
            ) from None
        netloc = ascii_host if port is None else f"{ascii_host}:{port}"
    ascii_url = urlunsplit((parts.scheme, netloc, quote(parts.path, safe=_PATH_SAFE), "", ""))
    _validate_url(ascii_url)
    if len(ascii_url) > MAX_LENGTH:
        raise ValidationError(
            f"At most {MAX_LENGTH} characters once in ASCII (an endpoint may not exceed "
            "1000 bytes)."
        )
    return ascii_url


def ascii_form(url: str) -> str:
    """`url` as endpoints and `Location` headers use it: `normalized`, or, for a row saved
    before that rule and not valid by it, percent-encoded as it stands."""
    try:
        return normalized(url)
    except ValidationError:
        return quote(url, safe=_URL_SAFE)
