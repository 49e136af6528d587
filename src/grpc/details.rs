//! The rich error model's messages that the layer writes into `grpc-status-details-bin`, and a
//! client reads back: `google.rpc.Status` holding a `google.rpc.ErrorInfo` (which of the layer's
//! answers it is) and, for the answers that say "later", a `google.rpc.RetryInfo` (how much
//! later). Hand-written `prost` messages with the field numbers of `google/rpc/status.proto`,
//! `google/rpc/error_details.proto`, `google/protobuf/any.proto` and
//! `google/protobuf/duration.proto`: no `protoc`, and no `prost-types`.

use std::time::Duration;

use bytes::Bytes;
use prost::Message;

/// The `type_url` of a packed `google.rpc.RetryInfo`.
pub(crate) const RETRY_INFO_TYPE: &str = "type.googleapis.com/google.rpc.RetryInfo";
/// The `type_url` of a packed `google.rpc.ErrorInfo`.
pub(crate) const ERROR_INFO_TYPE: &str = "type.googleapis.com/google.rpc.ErrorInfo";

/// `google.rpc.Status`: what `grpc-status-details-bin` holds.
#[derive(Clone, PartialEq, Message)]
pub(crate) struct RpcStatus {
    #[prost(int32, tag = "1")]
    pub(crate) code: i32,
    #[prost(string, tag = "2")]
    pub(crate) message: String,
    #[prost(message, repeated, tag = "3")]
    pub(crate) details: Vec<Any>,
}

/// `google.protobuf.Any`: a message and the name of its type.
#[derive(Clone, PartialEq, Message)]
pub(crate) struct Any {
    #[prost(string, tag = "1")]
    pub(crate) type_url: String,
    #[prost(bytes = "vec", tag = "2")]
    pub(crate) value: Vec<u8>,
}

/// `google.rpc.RetryInfo`: how long the client should wait before it retries.
#[derive(Clone, PartialEq, Message)]
pub(crate) struct RetryInfo {
    #[prost(message, optional, tag = "1")]
    pub(crate) retry_delay: Option<ProtoDuration>,
}

/// `google.protobuf.Duration`.
#[derive(Clone, PartialEq, Message)]
pub(crate) struct ProtoDuration {
    #[prost(int64, tag = "1")]
    pub(crate) seconds: i64,
    #[prost(int32, tag = "2")]
    pub(crate) nanos: i32,
}

/// `google.rpc.ErrorInfo`: the reason for an error, in the domain that names it.
#[derive(Clone, PartialEq, Message)]
pub(crate) struct ErrorInfo {
    #[prost(string, tag = "1")]
    pub(crate) reason: String,
    #[prost(string, tag = "2")]
    pub(crate) domain: String,
    #[prost(map = "string, string", tag = "3")]
    pub(crate) metadata: std::collections::HashMap<String, String>,
}

/// The `google.rpc.Status` of one of the layer's answers, encoded: its code and message, an
/// `ErrorInfo` with `reason` in `domain`, and a `RetryInfo` when there is a wait.
pub(crate) fn encode(
    code: i32,
    message: &str,
    reason: &str,
    domain: &str,
    retry_after: Option<Duration>,
) -> Bytes {
    let info = ErrorInfo {
        reason: reason.to_owned(),
        domain: domain.to_owned(),
        metadata: Default::default(),
    };
    let mut details = vec![Any {
        type_url: ERROR_INFO_TYPE.to_owned(),
        value: info.encode_to_vec(),
    }];
    if let Some(wait) = retry_after {
        let retry = RetryInfo {
            retry_delay: Some(ProtoDuration {
                seconds: i64::try_from(wait.as_secs()).unwrap_or(i64::MAX),
                nanos: wait.subsec_nanos() as i32,
            }),
        };
        details.push(Any {
            type_url: RETRY_INFO_TYPE.to_owned(),
            value: retry.encode_to_vec(),
        });
    }
    let status = RpcStatus {
        code,
        message: message.to_owned(),
        details,
    };
    Bytes::from(status.encode_to_vec())
}

/// Decodes a `google.rpc.Status` (the bytes of `tonic::Status::details`); `None` when the bytes
/// are not one.
pub(crate) fn decode(details: &[u8]) -> Option<RpcStatus> {
    if details.is_empty() {
        return None;
    }
    RpcStatus::decode(details).ok()
}

/// The wait a `google.rpc.Status` asks for in its `RetryInfo`, if it has one that is valid (not
/// negative).
pub(crate) fn retry_delay(status: &RpcStatus) -> Option<Duration> {
    let any = status
        .details
        .iter()
        .find(|any| any.type_url == RETRY_INFO_TYPE)?;
    let delay = RetryInfo::decode(&any.value[..]).ok()?.retry_delay?;
    let seconds = u64::try_from(delay.seconds).ok()?;
    let nanos = u32::try_from(delay.nanos)
        .ok()
        .filter(|n| *n < 1_000_000_000)?;
    Some(Duration::new(seconds, nanos))
}

/// The `ErrorInfo` of a `google.rpc.Status`, if it has one.
pub(crate) fn error_info(status: &RpcStatus) -> Option<ErrorInfo> {
    let any = status
        .details
        .iter()
        .find(|any| any.type_url == ERROR_INFO_TYPE)?;
    ErrorInfo::decode(&any.value[..]).ok()
}

#[cfg(test)]
mod tests {
    use base64::Engine as _;
    use base64::engine::DecodePaddingMode;
    use base64::engine::general_purpose::{self, GeneralPurpose, GeneralPurposeConfig};

    use super::*;

    /// Base64 as gRPC's `-bin` metadata reads it: the standard alphabet, padded or not.
    const BIN_METADATA: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        GeneralPurposeConfig::new()
            .with_encode_padding(false)
            .with_decode_padding_mode(DecodePaddingMode::Indifferent),
    );

    /// The `google.rpc.Status` in a `grpc-status-details-bin` value; `None` when it is not base64 of
    /// one. (Not `tonic::Status::from_header_map`, which panics on a value that is not base64.)
    fn from_header(value: &[u8]) -> Option<RpcStatus> {
        let bytes = BIN_METADATA.decode(value).ok()?;
        decode(&bytes)
    }

    #[test]
    fn a_status_with_retry_info_round_trips() {
        let bytes = encode(
            10,
            "in flight",
            "IN_FLIGHT",
            "tower-idempotency",
            Some(Duration::from_millis(1500)),
        );
        let status = decode(&bytes).unwrap();
        assert_eq!((status.code, status.message.as_str()), (10, "in flight"));
        assert_eq!(retry_delay(&status), Some(Duration::from_millis(1500)));
        let info = error_info(&status).unwrap();
        assert_eq!(
            (info.reason.as_str(), info.domain.as_str()),
            ("IN_FLIGHT", "tower-idempotency")
        );
        // As a `-bin` header value: unpadded, and read back padded or not.
        let unpadded = general_purpose::STANDARD_NO_PAD.encode(&bytes);
        assert!(!unpadded.ends_with('='));
        assert_eq!(from_header(unpadded.as_bytes()), Some(status.clone()));
        let padded = general_purpose::STANDARD.encode(&bytes);
        assert_eq!(from_header(padded.as_bytes()), Some(status));
    }

    #[test]
    fn the_wire_bytes_are_those_of_google_rpc() {
        // RetryInfo { retry_delay: Duration { seconds: 2 } }: field 1 (length 2) holding field 1 = 2.
        let retry = RetryInfo {
            retry_delay: Some(ProtoDuration {
                seconds: 2,
                nanos: 0,
            }),
        };
        assert_eq!(retry.encode_to_vec(), [0x0a, 0x02, 0x08, 0x02]);
    }

    #[test]
    fn bad_details_are_none_not_errors() {
        assert_eq!(from_header(b"not base64!"), None);
        assert_eq!(from_header(b""), None);
        assert_eq!(decode(&[0xff, 0xff]), None);
        let without = decode(&encode(14, "away", "STORE_UNAVAILABLE", "d", None)).unwrap();
        assert_eq!(retry_delay(&without), None);
        let negative = RpcStatus {
            code: 14,
            message: String::new(),
            details: vec![Any {
                type_url: RETRY_INFO_TYPE.into(),
                value: RetryInfo {
                    retry_delay: Some(ProtoDuration {
                        seconds: -1,
                        nanos: 0,
                    }),
                }
                .encode_to_vec(),
            }],
        };
        assert_eq!(retry_delay(&negative), None);
    }
}
