"""Who may do what: tokens, tenants and key scoping, TLS contexts and replies, process
hardening.
"""
