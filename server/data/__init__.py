"""The data path: the data port's connections, the op table, the same-host arena ops and
their counters.
"""
