"""The shape of each provider's payload, per app (`App.payload_options`); docs/protocols.md 1.4 when
nothing is set.

    {
      "fcm":  {"account_key": "account", "channel_key": "channel", "push_id_key": "",
               "notification_title": "", "notification_body": ""},
      "apns": {"account_key": "account", "channel_key": "channel", "push_id_key": "",
               "alert_title": "", "alert_body": "", "sound": "default",
               "mutable_content": false},
      "wns":  {"account_key": "account_id", "push_id_key": ""}
    }

- `*_key`: the name of a data field; `push_id_key` empty leaves the push id out (APNs always
  carries it as `apns-id`). With a key, a phone can drop a duplicate wake-up by its push id.
- FCM `notification_*`: important pushes also get a notification block (shown by Android when
  the app is not running); silent ones never do.
- APNs: the important push's generic alert (`alert_title` empty: the app's configured title,
  "New message"); `sound` empty for none; `mutable_content` for a notification service
  extension that fetches the message itself.

Options only rename or add fields that carry hashes, ids or fixed texts: no JID, body or token
can be put into a payload through them. Unknown options are refused, not ignored, so a typo
does not silently fall back to the default shape.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, TypeVar

# FCM refuses these data keys (and any starting with "google" or "gcm").
_FCM_RESERVED = frozenset({"from", "notification", "message_type", "collapse_key"})
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")
_TEXT_MAX = 200

T = TypeVar("T")


@dataclass(frozen=True)
class FcmPayload:
    account_key: str = "account"
    channel_key: str = "channel"
    push_id_key: str = ""
    notification_title: str = ""
    notification_body: str = ""

    def validate(self) -> None:
        keys = [k for k in (self.account_key, self.channel_key, self.push_id_key) if k]
        for key in keys:
            lowered = key.lower()
            if lowered in _FCM_RESERVED or lowered.startswith(("google", "gcm")):
                raise ValueError(f"FCM reserves the data key {key!r}")
        _distinct_keys(keys, "fcm")


@dataclass(frozen=True)
class ApnsPayload:
    account_key: str = "account"
    channel_key: str = "channel"
    push_id_key: str = ""
    alert_title: str = ""
    alert_body: str = ""
    sound: str = "default"
    mutable_content: bool = False

    def validate(self) -> None:
        keys = [k for k in (self.account_key, self.channel_key, self.push_id_key) if k]
        if "aps" in keys:
            raise ValueError("APNs reserves the payload key 'aps'")
        _distinct_keys(keys, "apns")


@dataclass(frozen=True)
class WnsPayload:
    account_key: str = "account_id"
    push_id_key: str = ""

    def validate(self) -> None:
        keys = [k for k in (self.account_key, self.push_id_key) if k]
        reserved = {"version", "action", "message_count", "pending_subscription_count"}
        for key in keys:
            if key in reserved:
                raise ValueError(f"WNS payload key {key!r} is taken by the body itself")
        _distinct_keys(keys, "wns")


def _distinct_keys(keys: list[str], where: str) -> None:
    if len(set(keys)) != len(keys):
        raise ValueError(f"payload options for {where}: two fields share one key")


def _parse(cls: type[T], options: Any, where: str) -> T:
    if options in (None, {}):
        return cls()
    if not isinstance(options, dict):
        raise ValueError(f"payload options for {where} must be an object")
    fields = {field.name: field for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(f"unknown payload options for {where}: {', '.join(unknown)}")
    values: dict[str, Any] = {}
    for name, value in options.items():
        default = fields[name].default
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"payload option {where}.{name} must be true or false")
        elif not isinstance(value, str):
            raise ValueError(f"payload option {where}.{name} must be text")
        elif name.endswith("_key"):
            if value and not _KEY.fullmatch(value):
                raise ValueError(f"payload option {where}.{name} is not a usable key: {value!r}")
            if not value and name == "account_key":
                raise ValueError(f"payload option {where}.account_key cannot be empty")
        elif len(value) > _TEXT_MAX:
            raise ValueError(f"payload option {where}.{name} is longer than {_TEXT_MAX}")
        values[name] = value
    payload = cls(**values)
    payload.validate()  # type: ignore[attr-defined]
    return payload


def fcm_payload(options: Any) -> FcmPayload:
    return _parse(FcmPayload, _section(options, "fcm"), "fcm")


def apns_payload(options: Any) -> ApnsPayload:
    return _parse(ApnsPayload, _section(options, "apns"), "apns")


def wns_payload(options: Any) -> WnsPayload:
    return _parse(WnsPayload, _section(options, "wns"), "wns")


def validate_options(options: Any) -> None:
    """Raise ValueError for anything in an app's `payload_options` that would not build."""
    if options in (None, {}):
        return
    if not isinstance(options, dict):
        raise ValueError("payload options must be an object with fcm/apns/wns sections")
    unknown = sorted(set(options) - {"fcm", "apns", "wns"})
    if unknown:
        raise ValueError(f"unknown payload option sections: {', '.join(unknown)}")
    fcm_payload(options)
    apns_payload(options)
    wns_payload(options)


def _section(options: Any, name: str) -> Any:
    if options in (None, {}):
        return None
    if not isinstance(options, dict):
        raise ValueError("payload options must be an object with fcm/apns/wns sections")
    return options.get(name)
