"""The Celery side: webhook delivery, batch expansion/cancel/finalize, and the outbox bridge feeding them.

May import: shared/ and workers/tasks/ only. The app (celery_app.py) imports no task module; the outbox
bridge reaches the tasks through registry.py.
"""
