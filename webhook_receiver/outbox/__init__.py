"""The outbox: each stored event's deliveries to its consumers, and their ordering.

The inbox writes a new event's deliveries in the event's own transaction
(:func:`.deliveries.new_delivery_columns`); the worker (``processing/``)
claims them under a lease and marks their outcome; the admin requeues or
discards dead ones; retention deletes an event only once all its
deliveries are final. :mod:`.deliveries` is the delivery record as a state
machine, :mod:`.ordering` the newest version applied per consumer and
entity, so an older event is skipped. Both are data access: they never
commit, and they import nothing above the foundation.
"""
