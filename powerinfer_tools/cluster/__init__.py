"""Work spread over a cluster of machines (Ray, the optional ``ray`` extra)."""
