// The approvals page's only script: redraw the live part of a page from the server.
// A session page redraws when its Server-Sent Events say something happened; the list of
// pending calls redraws every few seconds. Nothing is redrawn while you are deciding in a form.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) { return; }
  var refreshUrl = live.getAttribute("data-refresh");
  var eventsUrl = live.getAttribute("data-events");
  var timer = null;

  // A person deciding: focus in one of the forms, or text typed into one. Redrawing then would
  // throw their words away.
  function busy() {
    var el = document.activeElement;
    if (el && live.contains(el) && el.closest("form")) { return true; }
    var fields = live.querySelectorAll("textarea, input[type=text]");
    for (var i = 0; i < fields.length; i++) {
      if (fields[i].value !== "") { return true; }
    }
    return false;
  }

  function redraw() {
    timer = null;
    if (busy()) { schedule(1000); return; }
    fetch(refreshUrl, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (html === null || busy()) { return; }
        // Server-rendered and escaped by the server; the CSP forbids inline script besides.
        live.innerHTML = html;
        document.dispatchEvent(new CustomEvent("agents:redrawn"));
      })
      .catch(function () {});
  }

  function schedule(ms) {
    if (timer === null) { timer = window.setTimeout(redraw, ms); }
  }

  if (eventsUrl && window.EventSource) {
    var source = new EventSource(eventsUrl);
    source.onmessage = function () { schedule(150); };
  } else if (refreshUrl) {
    window.setInterval(function () { schedule(0); }, 5000);
  }
})();
