"""Cluster membership: the map from a static file or etcd, this node's entry in it, and
drain's hand-off.
"""
