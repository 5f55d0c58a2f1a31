"""The Redis store: each decision is one Lua script, atomic across hosts, on Redis's clock."""

from __future__ import annotations

import logging
from typing import Any

from relay.services.throttling.decisions import (
    GRACE_SECONDS,
    KEY_PREFIX,
    Admission,
    Ask,
    Bucket,
    Decision,
    Fold,
    Limit,
    Refusal,
    StateUnavailable,
    Taken,
)

log = logging.getLogger(__name__)

# --- Redis -------------------------------------------------------------------------------------

_ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local window = tonumber(ARGV[3])
local grace = tonumber(ARGV[4])
if rate > 0 then
  local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
  local tokens = tonumber(b[1])
  local ts = tonumber(b[2])
  if tokens == nil or ts == nil then
    tokens = burst
    ts = now
  end
  tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
  local ttl = math.ceil((burst / rate + 60) * 1000)
  if tokens < 1 then
    redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
    redis.call('PEXPIRE', KEYS[1], ttl)
    return {'limited', tostring((1 - tokens) / rate)}
  end
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1), 'ts', tostring(now))
  redis.call('PEXPIRE', KEYS[1], ttl)
end
if window <= 0 then
  return {'send', '0'}
end
local c = redis.call('HMGET', KEYS[2], 'last', 'pending', 'due')
local last = tonumber(c[1])
local pending = c[2]
local due = tonumber(c[3])
if pending and due and now < due + grace then
  if ARGV[6] == '1' then
    redis.call('HSET', KEYS[2], 'important', '1')
  end
  if ARGV[7] ~= '' then
    redis.call('HSET', KEYS[2], 'mc', ARGV[7])
  end
  if ARGV[8] ~= '' then
    redis.call('HSET', KEYS[2], 'psc', ARGV[8])
  end
  redis.call('HINCRBY', KEYS[2], 'folded', 1)
  return {'folded', pending}
end
if last and now - last < window then
  due = last + window
  redis.call('HSET', KEYS[2], 'pending', ARGV[5], 'due', tostring(due), 'important', ARGV[6],
             'mc', ARGV[7], 'psc', ARGV[8], 'folded', '0')
  redis.call('PEXPIRE', KEYS[2], math.ceil((due - now + grace) * 1000))
  return {'schedule', tostring(due - now)}
end
redis.call('HSET', KEYS[2], 'last', tostring(now))
redis.call('HDEL', KEYS[2], 'pending', 'due', 'important', 'mc', 'psc', 'folded')
redis.call('PEXPIRE', KEYS[2], math.ceil((window + grace) * 1000))
return {'send', '0'}
"""

_TAKE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local c = redis.call('HMGET', KEYS[1], 'pending', 'important', 'mc', 'psc', 'folded', 'last')
local last = tonumber(c[6])
if last == nil or last < now then
  redis.call('HSET', KEYS[1], 'last', tostring(now))
end
local ttl = math.ceil((tonumber(ARGV[2]) + tonumber(ARGV[3])) * 1000)
if c[1] == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'pending', 'due', 'important', 'mc', 'psc', 'folded')
  redis.call('PEXPIRE', KEYS[1], ttl)
  return {'1', c[2] or '0', c[3] or '', c[4] or '', c[5] or '0'}
end
if not c[1] then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return {'0'}
"""

# KEYS: the buckets; ARGV: rate and burst of each, in order. Takes a token from every bucket,
# or from none when one is empty; answers {'-1', '0'} or {index (0-based), seconds to wait}.
_TAKE_TOKENS_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tokens = {}
local empty = -1
local wait = 0
for i = 1, #KEYS do
  local rate = tonumber(ARGV[2 * i - 1])
  local burst = tonumber(ARGV[2 * i])
  local b = redis.call('HMGET', KEYS[i], 'tokens', 'ts')
  local have = tonumber(b[1])
  local ts = tonumber(b[2])
  if have == nil or ts == nil then
    have = burst
    ts = now
  end
  have = math.min(burst, have + math.max(0, now - ts) * rate)
  tokens[i] = have
  if have < 1 and empty < 0 then
    empty = i - 1
    wait = (1 - have) / rate
  end
end
for i = 1, #KEYS do
  local rate = tonumber(ARGV[2 * i - 1])
  local burst = tonumber(ARGV[2 * i])
  local left = tokens[i]
  if empty < 0 then
    left = left - 1
  end
  redis.call('HSET', KEYS[i], 'tokens', tostring(left), 'ts', tostring(now))
  redis.call('PEXPIRE', KEYS[i], math.ceil((burst / rate + 60) * 1000))
end
return {tostring(empty), tostring(wait)}
"""

_ABANDON_LUA = """
if redis.call('HGET', KEYS[1], 'pending') == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'pending', 'due', 'important', 'mc', 'psc', 'folded')
end
return {'1'}
"""


def _count(value: int | None) -> str:
    return "" if value is None else str(int(value))


def _parse_count(value: Any) -> int | None:
    if value in (None, "", b""):
        return None
    return int(value)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _admit_call(ask: Ask) -> tuple[list[str], list[Any]]:
    keys = [KEY_PREFIX + ask.bucket, KEY_PREFIX + ask.window_key]
    args = [
        repr(max(0.0, ask.limit.rate)),
        ask.limit.burst,
        repr(ask.window),
        repr(GRACE_SECONDS),
        ask.push_id,
        "1" if ask.fold.important else "0",
        _count(ask.fold.message_count),
        _count(ask.fold.pending_subscription_count),
    ]
    return keys, args


def _admission(answer: list[str]) -> Admission:
    decision = Decision(answer[0])
    if decision is Decision.FOLDED:
        return Admission(decision, push_id=answer[1])
    return Admission(decision, delay=max(0.0, float(answer[1])))


class RedisStore:
    def __init__(self, url: str) -> None:
        import redis

        self._errors = (redis.RedisError, OSError)
        self._no_script = redis.exceptions.NoScriptError
        self._client = redis.Redis.from_url(
            url, socket_timeout=0.5, socket_connect_timeout=0.5, health_check_interval=30
        )
        self._admit = self._client.register_script(_ADMIT_LUA)
        self._take = self._client.register_script(_TAKE_LUA)
        self._abandon = self._client.register_script(_ABANDON_LUA)
        self._take_tokens = self._client.register_script(_TAKE_TOKENS_LUA)

    def _run(self, script: Any, keys: list[str], args: list[Any]) -> list[str]:
        try:
            return [_text(item) for item in script(keys=keys, args=args)]
        except self._errors as error:
            raise StateUnavailable(type(error).__name__) from error

    def admit(
        self, bucket: str, limit: Limit, window_key: str, window: float, push_id: str, fold: Fold
    ) -> Admission:
        ask = Ask(bucket, limit, window_key, window, push_id, fold)
        keys, args = _admit_call(ask)
        return _admission(self._run(self._admit, keys, args))

    def admit_many(self, asks: list[Ask]) -> list[Admission]:
        """One pipeline of EVALSHA: one round trip per batch. (A script run through a pipeline
        makes redis-py ask SCRIPT EXISTS first, every time: a second round trip per batch.)
        Redis forgets scripts when it restarts or flushes them: then they are loaded again and
        the pipeline is run once more, which is safe because a refused EVALSHA ran nothing."""
        calls = [_admit_call(ask) for ask in asks]
        try:
            try:
                answers = self._admit_all(calls)
            except self._no_script:
                self._admit.sha = self._client.script_load(_ADMIT_LUA)
                answers = self._admit_all(calls)
        except self._errors as error:
            raise StateUnavailable(type(error).__name__) from error
        return [_admission([_text(item) for item in answer]) for answer in answers]

    def _admit_all(self, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for keys, args in calls:
            pipe.evalsha(self._admit.sha, len(keys), *keys, *args)
        return list(pipe.execute())

    def take(self, window_key: str, push_id: str, window: float) -> Taken | None:
        answer = self._run(
            self._take, [KEY_PREFIX + window_key], [push_id, repr(window), repr(GRACE_SECONDS)]
        )
        if answer[0] != "1":
            return None
        return Taken(
            important=answer[1] == "1",
            message_count=_parse_count(answer[2]),
            pending_subscription_count=_parse_count(answer[3]),
            folded=int(answer[4] or 0),
        )

    def abandon(self, window_key: str, push_id: str) -> None:
        self._run(self._abandon, [KEY_PREFIX + window_key], [push_id])

    def take_tokens(self, buckets: list[Bucket]) -> Refusal | None:
        args: list[Any] = []
        for bucket in buckets:
            args += [repr(bucket.limit.rate), bucket.limit.burst]
        answer = self._run(self._take_tokens, [KEY_PREFIX + b.key for b in buckets], args)
        index = int(answer[0])
        return None if index < 0 else Refusal(index, max(0.0, float(answer[1])))

    def ping(self) -> None:
        try:
            self._client.ping()
        except self._errors as error:
            raise StateUnavailable(type(error).__name__) from error

    def reset(self) -> None:
        try:
            keys = list(self._client.scan_iter(match=KEY_PREFIX + "*", count=1000))
            if keys:
                self._client.delete(*keys)
        except self._errors as error:
            raise StateUnavailable(type(error).__name__) from error
