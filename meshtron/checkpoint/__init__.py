"""meshtron.checkpoint"""
