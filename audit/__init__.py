"""Empirical privacy audits: canaries, the distinguishing game, and statistical lower bounds on epsilon."""
