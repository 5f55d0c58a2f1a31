"""A page of a fresh headless Chromium (Debian's, through Playwright) for the admin's
browser tests: the launch flags, the Content-Security-Policy check every page must pass,
and the database connections Playwright's event loop leaves behind."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connections
from playwright.sync_api import BrowserContext, Page, sync_playwright

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
]
# Every Content-Security-Policy violation reaches the console: Chromium's own "Refused to ..."
# errors, and this listener's line for the ones a page could otherwise swallow.
REPORT_VIOLATIONS = """
document.addEventListener("securitypolicyviolation", (event) => {
  console.error(`CSP violation: ${event.violatedDirective} ${event.blockedURI}`);
});
"""


def csp_violations(messages: list[str]) -> list[str]:
    return [text for text in messages if "Content Security Policy" in text or "CSP" in text]


@contextmanager
def chromium_page(*, width: int) -> Iterator[tuple[Page, BrowserContext]]:
    """A page and its context; fails when the block ends if any page tripped the policy.

    Playwright's sync API keeps an event loop in this thread, so the caller sets
    DJANGO_ALLOW_ASYNC_UNSAFE for its own (synchronous) ORM calls."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": width, "height": 900})
        context.set_default_timeout(20_000)
        context.add_init_script(REPORT_VIOLATIONS)
        page = context.new_page()
        console: list[str] = []
        page.on("console", lambda message: console.append(message.text))
        try:
            yield page, context
        finally:
            # The test's queries made while Playwright's loop ran had connections of that
            # context (asgiref's Local), not the test's: closed here, or the test database
            # stays busy at teardown.
            connections.close_all()
            context.close()
            browser.close()
        assert not csp_violations(console), csp_violations(console)
