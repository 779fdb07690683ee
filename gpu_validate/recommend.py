"""Compatibility re-export: ``kvsim recommend``'s library entry points now live in
`gpu_validate.studies.recommendation.recommender`; this module keeps ``from gpu_validate.recommend import
recommend_texts`` (and ``Recommender``) working for code written before the move."""

from gpu_validate.studies.recommendation.recommender import Recommender, recommend_texts

__all__ = ["Recommender", "recommend_texts"]
