"""The UWPX-style registration protocol of Windows clients (docs/protocols.md section 3).

Both entry points, the HTTP API (`relay.windows.api`) and the TLS listener
(`run_uwpx_listener`), call these functions: they validate, store and queue, and raise
`UwpxError` carrying the text the client is shown. The device id is the client's only
capability, so only its SHA-256 is stored, a device is found by that hash (a timing difference
in the index lookup cannot reveal the id) and the final equality checks use
`hmac.compare_digest`. Nothing here logs a device id, a channel URI, a JID, a node or a secret.

Accounts are named by a bare JID (the documented protocol) or, as the shipped UWPX client
does, by its account id, `sha256_hex(device_id + bare_jid)`. An account named by its id has no
known domain until its server first publishes: `relay.services.publishing` binds the
registration to that publishing domain then (node and secret are still required).

By concern: `identifiers` (ids, validation, the answers), `errors`, `limits` (rate limits),
`apps` (the app a request names, kept per process), `sql` (the hot requests' statements and
the connection they run on), `actions` (the three actions, each on its own transaction),
`batch` (the plain cases of concurrent requests in one commit, PostgreSQL), `store` (what
both paths build) and `housekeeping`.
"""

from relay.windows.services.actions import request_test_push, set_accounts, set_channel_uri
from relay.windows.services.apps import app_for_key, push_component
from relay.windows.services.errors import ErrorKind, UwpxError
from relay.windows.services.housekeeping import remove_stale_devices
from relay.windows.services.identifiers import (
    ACCOUNT_ID_PATTERN,
    APP_KEY_PATTERN,
    DEVICE_ID_PATTERN,
    DEVICE_ID_RULE,
    MAX_BARE_JID_LENGTH,
    MAX_CHANNEL_URI_LENGTH,
    UNKNOWN_DEVICE,
    AccountAnswer,
    AccountRef,
    AccountsAnswer,
    account_id,
    bare_jid_domain,
    device_id_hash,
    validate_channel_uri,
    validate_device_id,
)
from relay.windows.services.limits import check_address_rate, check_device_rate

__all__ = [
    "ACCOUNT_ID_PATTERN",
    "APP_KEY_PATTERN",
    "DEVICE_ID_PATTERN",
    "DEVICE_ID_RULE",
    "MAX_BARE_JID_LENGTH",
    "MAX_CHANNEL_URI_LENGTH",
    "UNKNOWN_DEVICE",
    "AccountAnswer",
    "AccountRef",
    "AccountsAnswer",
    "ErrorKind",
    "UwpxError",
    "account_id",
    "app_for_key",
    "bare_jid_domain",
    "check_address_rate",
    "check_device_rate",
    "device_id_hash",
    "push_component",
    "remove_stale_devices",
    "request_test_push",
    "set_accounts",
    "set_channel_uri",
    "validate_channel_uri",
    "validate_device_id",
]
