"""The Celery side: webhook delivery, batch expansion/cancel/finalize, and the outbox bridge feeding them."""
