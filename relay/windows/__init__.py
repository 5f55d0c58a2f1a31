"""The Windows (UWPX-style) API: Windows clients register their WNS channel and accounts over
HTTP JSON (docs/windows-api.md), or over the TLS listener (`manage.py run_uwpx_listener`).

`api` (the ninja views, the schemas, the protocol both entry points share), `services` (the
rules and the storage), `tasks` (stale devices), `management` (the listener), `models` (the
devices, `WnsDevice`, and their accounts, `WnsAccount`: which of the core's registrations
each is).
"""
