"""UnifiedPush over XMPP (the `up` protocol; Conversations is the distributor).

The phone registers an (application, instance) pair with a component and gets an endpoint
URL; application servers POST messages to it; the gateway relays each as a `<push>` iq to
the phone's full JID, and keeps what the phone did not take until its TTL.

- `keys`: the key ring (UNIFIEDPUSH_KEYS): endpoint tokens, messages sealed at rest, keyed
  hashes. The first key encrypts, every key decrypts.
- `tokens`: endpoint tokens (PASETO v4.local) that route a POST without a database row.
- `registration`: the register iq's logic (checks, token, expiration).
- `messages`: what the web process does with a POST (headers, limits, storing) and a DELETE.
- `store`: the message table: one statement per POST, batched resolutions for the gateway.
- `delivery`: the gateway's rules (answers, backoff) as plain functions.
- `matrix`: the Matrix push gateway (`/_matrix/push/v1/notify`) on top of `messages`.
"""

UP_NS = "http://gultsch.de/xmpp/drafts/unified-push"
