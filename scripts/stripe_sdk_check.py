#!/usr/bin/env python3
"""Drive fakestripe with Stripe's own Python library, as a user of that library would.

    python scripts/stripe_sdk_check.py http://127.0.0.1:12121

Run by scripts/stripe-sdk-check.sh, which starts fakestripe and installs a pinned `stripe`
package into a venv. The only thing changed from a program written for the real Stripe is the
API base: the modern `stripe.StripeClient` (recommended by the library since v8; this script
uses its `v1` namespace, as v16 does) gets `base_addresses={"api": <base>}`.

Prints one line per check ("ok  …" or "FAIL …") and a last line "N passed, M failed"; exits
non-zero when any check fails. It makes its own customers and idempotency keys on every run, so
it passes on a database that still holds the data of earlier runs.
"""

from __future__ import annotations

import sys
import traceback
import uuid
from typing import Callable, List, Optional
from urllib.parse import urlsplit

import stripe

API_KEY = "sk_test_sdkcheck"
# fakestripe accepts any key shaped `sk_test_[A-Za-z0-9_]+` (each one its own account), so a
# key that the real Stripe would refuse too has to be of another shape.
BAD_API_KEY = "sk_test_not-a-valid-key"
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


class Check:
    """Runs named checks, prints one line for each, and counts them."""

    def __init__(self) -> None:
        self.passed = 0
        self.failed = 0

    def run(self, name: str, body: Callable[[], None]) -> bool:
        try:
            body()
        except Exception as e:  # noqa: BLE001 - any failure of a check is reported, not raised
            traceback.print_exc(file=sys.stderr)
            self.fail(name, f"{type(e).__name__}: {e}")
            return False
        self.passed += 1
        print(f"ok  {name}", flush=True)
        return True

    def fail(self, name: str, reason: str) -> None:
        self.failed += 1
        # One line per check, even for the library's multi-line messages.
        print(f"FAIL {name}: {' '.join(reason.split())}", flush=True)


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def header(obj: stripe.StripeObject, name: str) -> Optional[str]:
    """A response header of the request that returned `obj` (case-insensitive)."""
    response = obj.last_response
    expect(response is not None, "the library kept no last_response")
    assert response is not None
    for key, value in response.headers.items():
        if key.lower() == name.lower():
            return value
    return None


def new_key(label: str) -> str:
    # Unique per run: the database keeps the keys (and charges) of earlier runs.
    return f"sdk-check-{label}-{uuid.uuid4()}"


def main(argv: List[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} BASE_URL   (e.g. http://127.0.0.1:12121)", file=sys.stderr)
        return 2
    base = argv[1].rstrip("/")
    host = urlsplit(base).hostname
    if host not in LOOPBACK_HOSTS:
        print(f"refusing a non-loopback API base {base!r}: this check talks to fakestripe only",
              file=sys.stderr)
        return 2

    # max_network_retries=0, explicitly. The library retries connection errors, 409s and 5xx
    # (same Idempotency-Key, with backoff) whenever retries are on; the module-level default
    # `stripe.max_network_retries` is 2, and StripeClient's own default (None) has meant
    # different things across versions. Any retry would hide what this check is about: a
    # request that fakestripe answers wrongly (a 409, a 500, a dropped connection) must fail
    # here instead of being papered over by a silent second attempt, and each replay asserted
    # below must be the one request we sent, not a retry the library made on its own.
    client = stripe.StripeClient(
        API_KEY,
        base_addresses={"api": base},
        max_network_retries=0,
    )
    bad_client = stripe.StripeClient(
        BAD_API_KEY,
        base_addresses={"api": base},
        max_network_retries=0,
    )

    check = Check()
    state: dict = {}
    amount = 2000

    def create_customer() -> None:
        customer = client.v1.customers.create(
            params={"email": "sdk-check@example.com", "source": "tok_visa"}
        )
        expect(customer.id.startswith("cus_"), f"customer id {customer.id!r}")
        expect(customer.object == "customer", f"object {customer.object!r}")
        expect(header(customer, "Request-Id") is not None,
               "no Request-Id: did the request reach fakestripe?")
        state["customer"] = customer.id

    def create_charge() -> None:
        key = new_key("charge")
        charge = client.v1.charges.create(
            params={
                "amount": amount,
                "currency": "usd",
                "customer": state["customer"],
                "description": "stripe sdk check",
                "metadata": {"check": "sdk"},
            },
            options={"idempotency_key": key},
        )
        expect(charge.id.startswith("ch_"), f"charge id {charge.id!r}")
        expect(charge.object == "charge", f"object {charge.object!r}")
        expect(charge.amount == amount, f"amount {charge.amount!r}")
        expect(charge.currency == "usd", f"currency {charge.currency!r}")
        expect(charge.paid is True, f"paid {charge.paid!r}")
        expect(charge.status == "succeeded", f"status {charge.status!r}")
        expect(charge.customer == state["customer"], f"customer {charge.customer!r}")
        expect(charge.metadata.to_dict() == {"check": "sdk"},
               f"metadata {charge.metadata!r}")
        expect(header(charge, "Idempotent-Replayed") is None,
               "a first request was marked as replayed")
        state["key"] = key
        state["charge"] = charge.id
        state["charges"] = [charge.id]

    def replay_charge() -> None:
        charge = client.v1.charges.create(
            params={
                "amount": amount,
                "currency": "usd",
                "customer": state["customer"],
                "description": "stripe sdk check",
                "metadata": {"check": "sdk"},
            },
            options={"idempotency_key": state["key"]},
        )
        expect(charge.id == state["charge"], f"replay gave {charge.id!r}, not {state['charge']!r}")
        replayed = header(charge, "Idempotent-Replayed")
        expect(replayed == "true", f"Idempotent-Replayed: {replayed!r}")

    def reuse_key_with_other_amount() -> None:
        try:
            client.v1.charges.create(
                params={
                    "amount": amount + 1,
                    "currency": "usd",
                    "customer": state["customer"],
                    "description": "stripe sdk check",
                    "metadata": {"check": "sdk"},
                },
                options={"idempotency_key": state["key"]},
            )
        except stripe.IdempotencyError as e:
            # The same class under its older name, as code written for earlier versions uses it.
            expect(isinstance(e, stripe.error.IdempotencyError), "not stripe.error.IdempotencyError")
            expect(e.http_status == 400, f"status {e.http_status!r}")
            expect(e.error is not None and e.error.type == "idempotency_error",
                   f"error object {e.error!r}")
            return
        raise AssertionError("no IdempotencyError")

    def declined_card() -> None:
        customer = client.v1.customers.create(
            params={"email": "declined@example.com", "source": "tok_chargeCustomerFail"}
        )
        expect(customer.id.startswith("cus_"), f"customer id {customer.id!r}")
        try:
            client.v1.charges.create(
                params={"amount": 1500, "currency": "usd", "customer": customer.id},
                options={"idempotency_key": new_key("declined")},
            )
        except stripe.CardError as e:
            expect(e.code == "card_declined", f"code {e.code!r}")
            expect(e.http_status == 402, f"status {e.http_status!r}")
            expect(e.error is not None and e.error.type == "card_error",
                   f"error object {e.error!r}")
            return
        raise AssertionError("no CardError")

    def retrieve_charge() -> None:
        charge = client.v1.charges.retrieve(state["charge"])
        expect(charge.id == state["charge"], f"id {charge.id!r}")
        expect(charge.amount == amount, f"amount {charge.amount!r}")
        expect(charge.customer == state["customer"], f"customer {charge.customer!r}")

    def list_with_auto_pagination() -> None:
        # Four more charges, so that limit=2 needs three pages for the customer's five.
        for extra in range(4):
            charge = client.v1.charges.create(
                params={"amount": 1000 + extra, "currency": "usd", "customer": state["customer"]},
                options={"idempotency_key": new_key(f"list-{extra}")},
            )
            state["charges"].append(charge.id)
        page = client.v1.charges.list(params={"customer": state["customer"], "limit": 2})
        expect(len(page.data) == 2, f"first page has {len(page.data)} charges")
        expect(page.has_more is True, "first page says has_more=false")
        seen = [charge.id for charge in page.auto_paging_iter()]
        for charge_id in state["charges"]:
            expect(seen.count(charge_id) == 1, f"{charge_id} listed {seen.count(charge_id)} times")
        expect(sorted(seen) == sorted(state["charges"]),
               f"listed {seen}, created {state['charges']}")
        # Newest first, as Stripe lists them.
        expect(seen == list(reversed(state["charges"])), f"order {seen}")

    def invalid_amount() -> None:
        try:
            client.v1.charges.create(
                params={"amount": -5, "currency": "usd", "customer": state["customer"]},
            )
        except stripe.InvalidRequestError as e:
            expect(e.param == "amount", f"param {e.param!r}")
            expect(e.http_status == 400, f"status {e.http_status!r}")
            return
        raise AssertionError("no InvalidRequestError")

    def bad_api_key() -> None:
        try:
            bad_client.v1.charges.list(params={"limit": 1})
        except stripe.AuthenticationError as e:
            # 401 means the server refused it; the library's own "no API key" check has none.
            expect(e.http_status == 401, f"status {e.http_status!r}")
            return
        raise AssertionError("no AuthenticationError")

    print(f"stripe-python {stripe.VERSION} (API version {stripe.api_version}) against {base}",
          flush=True)
    # (name, check, the check it needs to have passed first)
    checks = [
        ("create a customer with tok_visa", create_customer, None),
        ("charge with an idempotency key", create_charge, "create a customer with tok_visa"),
        ("replay returns the same charge", replay_charge, "charge with an idempotency key"),
        ("same key, other amount raises IdempotencyError", reuse_key_with_other_amount,
         "charge with an idempotency key"),
        ("retrieve the charge by id", retrieve_charge, "charge with an idempotency key"),
        ("auto-pagination lists every charge exactly once", list_with_auto_pagination,
         "charge with an idempotency key"),
        ("negative amount raises InvalidRequestError(param=amount)", invalid_amount,
         "create a customer with tok_visa"),
        ("tok_chargeCustomerFail raises CardError(card_declined)", declined_card, None),
        ("bad API key raises AuthenticationError", bad_api_key, None),
    ]
    passed = set()
    for name, body, needs in checks:
        if needs is not None and needs not in passed:
            # A check that cannot run counts as failed, so that the summary never hides it.
            check.fail(name, f"not run: needs {needs!r}")
        elif check.run(name, body):
            passed.add(name)
    print(f"{check.passed} passed, {check.failed} failed", flush=True)
    return 0 if check.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
