"""UnifiedPush over XMPP: the relay as push server for apps (Mastodon, Matrix clients, ...) with
Conversations as distributor (docs/unifiedpush.md).

All of it lives here: `models` (messages not yet taken, revocations, delivery records),
`admin`, `http` (the push resource and the Matrix push gateway, served on the web process's
event loop), `services` (tokens, keys, the store, the rules), `gateway` (what the gateway
plugs in: the register iq, relaying to phones, the direct path's listener), `checks`,
`migrations`.
"""
