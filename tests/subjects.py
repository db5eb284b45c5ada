"""A subject key store for the crypto-shredding races of the tests."""

from __future__ import annotations

from outboxer.crypto import FileSubjectKeys


class ShredDuringRead(FileSubjectKeys):
    """``outboxer keys shred`` landing just after someone read the subject's secret."""

    shred_after_read = False

    def get(self, subject: str) -> bytes | None:
        secret = super().get(subject)
        if self.shred_after_read and secret is not None:
            self.delete(subject)
        return secret
