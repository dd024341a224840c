"""meshtron.training"""
