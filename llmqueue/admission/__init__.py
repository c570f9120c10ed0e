"""Admission: the decision (decision.py), one API request's answer (request.py), and the
books in Redis that workers settle (books.py)."""
