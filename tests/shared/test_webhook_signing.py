"""Standard Webhooks signing, checked against the spec's published test vector."""

import pytest

from shared.webhook_signing import DEV_WEBHOOK_SECRET, InvalidSignature, sign, signed_headers, verify

SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TIMESTAMP = 1614265330
SPEC_BODY = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_spec_vector() -> None:
    assert sign(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY) == SPEC_SIGNATURE


def test_verify_accepts_the_spec_vector_and_rotated_signatures() -> None:
    headers = {
        "webhook-id": SPEC_ID,
        "webhook-timestamp": str(SPEC_TIMESTAMP),
        "webhook-signature": SPEC_SIGNATURE,
    }
    verify(SPEC_SECRET, headers, SPEC_BODY, now_s=SPEC_TIMESTAMP + 10)
    rotated = {**headers, "webhook-signature": f"v1,b2xkc2lnbmF0dXJl {SPEC_SIGNATURE}"}
    verify(SPEC_SECRET, rotated, SPEC_BODY, now_s=SPEC_TIMESTAMP)


@pytest.mark.parametrize(
    ("change", "now_offset_s"),
    [
        ({"webhook-id": "msg_other"}, 0),
        ({"webhook-signature": "v1,AAAA"}, 0),
        ({}, 3600),  # stale timestamp: replay
        ({"webhook-timestamp": "soon"}, 0),
    ],
)
def test_verify_refuses(change: dict[str, str], now_offset_s: int) -> None:
    headers = signed_headers(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY)
    with pytest.raises(InvalidSignature):
        verify(SPEC_SECRET, {**headers, **change}, SPEC_BODY, now_s=SPEC_TIMESTAMP + now_offset_s)
    with pytest.raises(InvalidSignature):
        verify(SPEC_SECRET, headers, SPEC_BODY + b" ", now_s=SPEC_TIMESTAMP)


def test_dev_secret_is_a_valid_secret() -> None:
    assert sign(DEV_WEBHOOK_SECRET, "msg_1", 1, b"{}").startswith("v1,")
