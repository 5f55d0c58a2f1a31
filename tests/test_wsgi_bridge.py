"""The WSGI bridge of the web process (pushsite/wsgi_bridge.py) against PEP 3333: the
environ it builds and the way it calls an application, checked by the standard library's
own validator (wsgiref.validate), which fails on a missing or mistyped key, a wrong call of
start_response, or a result not closed."""

from __future__ import annotations

import sys
from typing import Any
from wsgiref.validate import validator

import pytest

from pushsite import wsgi_bridge

pytestmark = pytest.mark.defaults


def _environ(**overrides: Any) -> dict[str, Any]:
    request = {
        "method": "POST",
        "target": "/admin/caf%C3%A9/x%2Fy?q=1&r=%20",
        "version": "HTTP/1.1",
        "headers": [
            (b"Host", b"push.example:8000"),
            (b"Content-Type", b"application/json"),
            (b"Content-Length", b"7"),
            (b"X-Forwarded-Proto", b"https"),
            (b"X_Forwarded_Proto", b"http"),  # an underscore: dropped
            (b"Accept", b"text/html"),
            (b"accept", b"application/json"),
            (b"Cookie", "a=\u20ac".encode()),  # UTF-8 bytes, as a browser sends them
        ],
        "body": b'{"a":1}',
        "remote": "192.0.2.7",
        "server": ("127.0.0.1", 8000),
        "multiprocess": True,
    }
    return wsgi_bridge.environ(**{**request, **overrides})


def test_the_environ_is_pep_3333s():
    seen: dict[str, Any] = {}

    def application(environ, start_response):
        seen.update(environ)
        seen["body"] = environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"]))
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [b"made"]

    status, reason, headers, body = wsgi_bridge.run(validator(application), _environ())
    assert (status, reason, headers, body) == (
        201, "Created", [("Content-Type", "text/plain")], b"made"
    )  # fmt: skip
    # The path decoded to bytes and carried as latin-1; the query as it came.
    assert seen["PATH_INFO"] == "/admin/café/x/y".encode().decode("latin-1")
    assert seen["QUERY_STRING"] == "q=1&r=%20"
    assert seen["CONTENT_TYPE"] == "application/json" and seen["CONTENT_LENGTH"] == "7"
    assert seen["body"] == b'{"a":1}'
    assert seen["HTTP_X_FORWARDED_PROTO"] == "https"  # not overwritten by X_Forwarded_Proto
    assert seen["HTTP_ACCEPT"] == "text/html,application/json"
    assert seen["HTTP_HOST"] == "push.example:8000"
    assert (seen["SERVER_NAME"], seen["SERVER_PORT"]) == ("127.0.0.1", "8000")
    assert seen["REMOTE_ADDR"] == "192.0.2.7" and seen["SERVER_PROTOCOL"] == "HTTP/1.1"
    assert "HTTP_CONTENT_TYPE" not in seen and "HTTP_CONTENT_LENGTH" not in seen
    # Header values are latin-1 strings of the bytes that came (PEP 3333).
    assert seen["HTTP_COOKIE"] == "a=\u20ac".encode().decode("latin-1")


def test_an_absolute_form_targets_authority_is_the_host():
    seen: dict[str, Any] = {}

    def application(environ, start_response):
        seen.update(environ)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b""]

    environ = _environ(target="/x?\udcff=1", authority="push.example")
    wsgi_bridge.run(validator(application), environ)
    assert seen["HTTP_HOST"] == "push.example"
    assert seen["QUERY_STRING"] == "\xff=1"  # the byte that came, carried as latin-1


def test_a_chunked_body_read_whole_gets_its_length():
    def application(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [environ["CONTENT_LENGTH"].encode()]

    headers = [(b"Host", b"a.example"), (b"Transfer-Encoding", b"chunked")]
    environ = _environ(headers=headers, body=b"abc")
    assert wsgi_bridge.run(validator(application), environ)[3] == b"3"


def test_the_result_is_iterated_and_closed_even_when_it_fails():
    closed = []

    class Result:
        def __init__(self, fail: bool) -> None:
            self.fail = fail

        def __iter__(self):
            yield b"one "
            if self.fail:
                raise RuntimeError("mid-answer")
            yield b""
            yield b"two"

        def close(self) -> None:
            closed.append(self.fail)

    def application(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return Result(environ["PATH_INFO"] == "/fail")

    assert wsgi_bridge.run(application, _environ(target="/fine"))[3] == b"one two"
    with pytest.raises(RuntimeError, match="mid-answer"):
        wsgi_bridge.run(application, _environ(target="/fail"))
    assert closed == [False, True]


def test_start_response_with_exc_info_replaces_the_answer_and_without_it_is_refused():
    def recovers(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        try:
            raise ValueError("late")
        except ValueError:
            start_response("500 Internal Server Error", [("X-Late", "1")], sys.exc_info())
        return [b"sorry"]

    assert wsgi_bridge.run(recovers, _environ()) == (
        500, "Internal Server Error", [("X-Late", "1")], b"sorry"
    )  # fmt: skip

    def twice(environ, start_response):
        start_response("200 OK", [])
        start_response("204 No Content", [])
        return []

    with pytest.raises(AssertionError, match="twice"):
        wsgi_bridge.run(twice, _environ())

    def silent(environ, start_response):
        return [b"no status"]

    with pytest.raises(RuntimeError, match="start_response"):
        wsgi_bridge.run(silent, _environ())


def test_write_callable_output_comes_before_the_result():
    def legacy(environ, start_response):
        write = start_response("200 OK", [("Content-Type", "text/plain")])
        write(b"written ")
        return [b"returned"]

    assert wsgi_bridge.run(legacy, _environ())[3] == b"written returned"
